"""Loading a Hugging Face Qwen2 / Llama checkpoint directory into a :class:`Decoder`.

The directory holds ``config.json`` and either ``model.safetensors`` or a sharded set named by
``model.safetensors.index.json``. Tensors are read with ``safetensors`` (no torch); linear
weights, stored ``[out, in]`` by ``nn.Linear``, are transposed to ``[in, out]``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from grpo_kernels.models.config import ModelConfig
from grpo_kernels.models.decoder import Decoder, check_loaded, empty_decoder

_LINEAR = {"self_attn.q_proj": ("attn", "q"), "self_attn.k_proj": ("attn", "k"),
           "self_attn.v_proj": ("attn", "v"), "self_attn.o_proj": ("attn", "o"),
           "mlp.gate_proj": ("mlp", "gate"), "mlp.up_proj": ("mlp", "up"),
           "mlp.down_proj": ("mlp", "down")}
_BIAS = {"self_attn.q_proj.bias": ("attn", "q_bias"), "self_attn.k_proj.bias": ("attn", "k_bias"),
         "self_attn.v_proj.bias": ("attn", "v_bias")}
_NORMS = {"input_layernorm.weight": "input_norm", "post_attention_layernorm.weight": "post_norm"}


def checkpoint_files(path: str) -> dict[str, str]:
    """``{tensor name: safetensors file}`` of a checkpoint directory."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' mapping")
        files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        for file in set(files.values()):
            if not os.path.isfile(file):
                raise ValueError(f"{index} names {os.path.basename(file)}, which is missing "
                                 f"from {path}")
        return files
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="flax") as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (not a dict)
    raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")


def read_tensors(files: dict[str, str]) -> dict[str, Any]:
    """Every tensor as an array (``safetensors`` with the flax reader, which keeps bfloat16)."""
    from safetensors import safe_open

    out: dict[str, Any] = {}
    by_file: dict[str, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="flax") as f:
            for name in names:
                out[name] = f.get_tensor(name)
    return out


def expected_tensors(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], Callable]]:
    """``{HF tensor name: (HF shape, setter(model, array))}`` for every weight of the model."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"self_attn.q_proj": (q, c.hidden_size), "self_attn.k_proj": (kv, c.hidden_size),
              "self_attn.v_proj": (kv, c.hidden_size), "self_attn.o_proj": (c.hidden_size, q),
              "mlp.gate_proj": (c.intermediate_size, c.hidden_size),
              "mlp.up_proj": (c.intermediate_size, c.hidden_size),
              "mlp.down_proj": (c.hidden_size, c.intermediate_size)}
    bias_shapes = {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                   "self_attn.v_proj.bias": (kv,)}

    def setter(path: tuple[Any, ...], transpose: bool = False):
        def put(model: Decoder, x: Any) -> None:
            node: Any = model
            for p in path[:-1]:
                node = node[p] if isinstance(p, int) else getattr(node, p)
            param = getattr(node, path[-1])
            x = jnp.asarray(x)
            param.set_value((x.T if transpose else x).astype(c.param_dtype))
        return put

    want: dict[str, tuple[tuple[int, ...], Callable]] = {
        "model.embed_tokens.weight": ((c.vocab_size, c.hidden_size), setter(("embed",))),
        "model.norm.weight": ((c.hidden_size,), setter(("norm", "weight"))),
    }
    if not c.tie_word_embeddings:
        want["lm_head.weight"] = ((c.vocab_size, c.hidden_size), setter(("lm_head",)))
    for i in range(c.num_layers):
        pre = f"model.layers.{i}."
        for hf, (mod, attr) in _LINEAR.items():
            want[pre + hf + ".weight"] = (shapes[hf], setter(("layers", i, mod, attr), True))
        if c.attention_bias:
            for hf, (mod, attr) in _BIAS.items():
                want[pre + hf] = (bias_shapes[hf], setter(("layers", i, mod, attr)))
        for hf, attr in _NORMS.items():
            want[pre + hf] = ((c.hidden_size,), setter(("layers", i, attr, "weight")))
    return want


def load_hf_checkpoint(path: str, *, param_dtype: Any = jnp.float32,
                       compute_dtype: Any = jnp.bfloat16, remat: bool = False,
                       ) -> tuple[ModelConfig, Decoder]:
    """``(config, model)`` from a Hugging Face checkpoint directory.

    Raises:
      ValueError: a missing file, an unknown architecture, a missing tensor, or a tensor whose
        shape differs from what config.json implies (naming the file, tensor and shapes).
    """
    if not os.path.isdir(path):
        raise ValueError(f"{path}: not a checkpoint directory")
    config = ModelConfig.from_json(path, param_dtype=param_dtype, compute_dtype=compute_dtype)
    files = checkpoint_files(path)
    want = expected_tensors(config)
    missing = sorted(set(want) - set(files))
    if missing:
        raise ValueError(f"{path}: missing tensor(s) {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''} for {config.family} with "
                         f"{config.num_layers} layers")
    tensors = read_tensors({k: files[k] for k in want})
    model = empty_decoder(config, remat)
    for name, (shape, put) in want.items():
        got = tuple(np.shape(tensors[name]))
        if got != shape:
            raise ValueError(f"{files[name]}: tensor {name!r} has shape {got}, config.json "
                             f"implies {shape}")
        put(model, tensors.pop(name))
    return config, check_loaded(model, path)
