"""``ModelConfig``: the Qwen2 / Llama decoder's shape, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import jax.numpy as jnp

ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and options of a Qwen2 / Llama family decoder.

    Attributes:
      family: ``"qwen2"`` (q/k/v projections with bias) or ``"llama"``.
      vocab_size: Rows of the embedding and the head.
      hidden_size: Width of the residual stream.
      intermediate_size: Width of the MLP.
      num_layers: Decoder layers.
      num_heads: Query heads; a multiple of ``num_kv_heads`` (grouped-query attention).
      num_kv_heads: Key and value heads.
      head_dim: Width of one head.
      rms_norm_eps: RMSNorm epsilon.
      rope_theta: RoPE base.
      rope_scaling: ``None`` or a mapping with ``rope_type`` ``"linear"`` (``factor``) or
        ``"llama3"`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
        ``original_max_position_embeddings``).
      attention_bias: q/k/v projections carry a bias (Qwen2: True).
      tie_word_embeddings: the LM head is the embedding matrix.
      max_position_embeddings: longest position the checkpoint was trained for.
      param_dtype: dtype the weights are stored in (default float32).
      compute_dtype: dtype of activations and matmuls (default bfloat16; norms, softmax and
        RoPE run in float32).
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.bfloat16

    def __post_init__(self) -> None:
        if self.family not in ARCHITECTURES.values():
            raise ValueError(f"family must be one of {sorted(ARCHITECTURES.values())}, "
                             f"got {self.family!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be an int >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ROPE_TYPES:
                raise ValueError(f"rope_scaling type must be one of {ROPE_TYPES}, got {kind!r}")

    @property
    def rope_type(self) -> str:
        if self.rope_scaling is None:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, values: Mapping[str, Any], source: str = "config.json",
                **overrides: Any) -> "ModelConfig":
        """From a Hugging Face config mapping, transformers 4 or 5 spelling.

        transformers 5 moved ``rope_theta`` and ``rope_scaling`` into ``rope_parameters`` and
        renamed ``torch_dtype`` to ``dtype``; both are read. The checkpoint dtype is not applied
        (``param_dtype`` defaults to float32); pass ``param_dtype=`` to keep it.
        """
        archs = values.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None:
            family = {"qwen2": "qwen2", "llama": "llama"}.get(values.get("model_type"))
        if family is None:
            raise ValueError(f"{source}: unknown architecture {archs or values.get('model_type')!r}"
                             f"; supported: {sorted(ARCHITECTURES)}")

        def need(key):
            if key not in values:
                raise ValueError(f"{source}: missing key {key!r}")
            return values[key]

        rope = dict(values.get("rope_parameters") or {})
        theta = values.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = values.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        kwargs = dict(
            family=family, vocab_size=need("vocab_size"), hidden_size=hidden,
            intermediate_size=need("intermediate_size"), num_layers=need("num_hidden_layers"),
            num_heads=heads, num_kv_heads=values.get("num_key_value_heads") or heads,
            head_dim=values.get("head_dim") or hidden // heads,
            rms_norm_eps=values.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=scaling,
            attention_bias=values.get("attention_bias", family == "qwen2"),
            tie_word_embeddings=bool(values.get("tie_word_embeddings", False)),
            max_position_embeddings=values.get("max_position_embeddings", 32768))
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str, **overrides: Any) -> "ModelConfig":
        """From a ``config.json`` file (or a checkpoint directory holding one)."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"{path}: no such file (a Hugging Face checkpoint needs config.json)")
        with open(path, encoding="utf-8") as f:
            try:
                values = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON: {e}") from None
        return cls.from_hf(values, source=path, **overrides)
