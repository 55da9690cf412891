"""The sections of ``TrainConfig`` (:mod:`grpo_kernels.rl.config`), each validated on
construction with every error naming its dotted key."""

from __future__ import annotations

import dataclasses

from grpo_kernels.config import check_sampler_truncation
from grpo_kernels.ops import LOSS_HEADS, LOSS_IMPLS
from grpo_kernels.ops.core.dtypes import DTYPE_CHOICES
from grpo_kernels.rl.kernel import build_options
from grpo_kernels.rl.schema import Section, choice, fail, finite, positive

DATA_SOURCES = ("arithmetic", "gsm8k")
SCALE_REWARDS = ("group", "batch", "none")
WANDB_MODES = ("disabled", "offline", "online")
DEFAULT_SYSTEM_PROMPT = ("Reason step by step, briefly. End with the final answer alone on the "
                         "last line as '#### <number>'.")


@dataclasses.dataclass(frozen=True)
class DataSection(Section):
    """The prompts.

    Attributes:
      source: ``arithmetic`` (word problems generated here; nothing to download) or ``gsm8k``
        (a jsonl file with ``question`` and ``answer`` ending in ``#### N``).
      path: The GSM8K jsonl file.
      difficulty: Arithmetic level 1 (one step), 2 (two steps) or 3 (three steps).
      num_problems: Size of the generated arithmetic pool.
      system_prompt: System message of every prompt.
    """

    KEY = "data"

    source: str = "arithmetic"
    path: str | None = None
    difficulty: int = 1
    num_problems: int = 5000
    system_prompt: str = DEFAULT_SYSTEM_PROMPT

    def validate(self, key: str) -> None:
        choice(f"{key}.source", self.source, DATA_SOURCES)
        if self.source == "gsm8k" and not self.path:
            fail(f"{key}.path", "data.source='gsm8k' needs the path of a GSM8K jsonl file")
        if self.difficulty not in (1, 2, 3):
            fail(f"{key}.difficulty", f"must be 1, 2 or 3, got {self.difficulty!r}")
        positive(f"{key}.num_problems", self.num_problems)


@dataclasses.dataclass(frozen=True)
class RewardFunction(Section):
    """One reward function of ``rl.rewards.REWARD_FUNCTIONS`` and its weight."""

    KEY = "rewards.functions[]"

    name: str
    weight: float = 1.0

    def validate(self, key: str) -> None:
        from grpo_kernels.rl.rewards import REWARD_FUNCTIONS

        choice(f"{key}.name", self.name, tuple(REWARD_FUNCTIONS))
        finite(f"{key}.weight", self.weight)


@dataclasses.dataclass(frozen=True)
class RewardsSection(Section):
    """Rewards and advantages.

    Attributes:
      functions: The reward functions, each named and weighted; the reward is the weighted sum.
      scale_rewards: Advantage ``(r - mean_g) / (std + 1e-4)`` with the std of the ``group``, of
        the ``batch``, or ``none`` (no division), as TRL's ``scale_rewards``.
    """

    KEY = "rewards"

    functions: tuple[RewardFunction, ...] = (RewardFunction("correctness", 1.0),
                                             RewardFunction("format", 0.5))
    scale_rewards: str = "group"

    def validate(self, key: str) -> None:
        if not self.functions:
            fail(f"{key}.functions", "name at least one reward function")
        choice(f"{key}.scale_rewards", self.scale_rewards, SCALE_REWARDS)


@dataclasses.dataclass(frozen=True)
class RolloutSection(Section):
    """Sampling.

    Attributes:
      batch_size: Completions per step (``B``): ``B / num_generations`` prompts.
      num_generations: Completions per prompt (the group), >= 2.
      max_new_tokens: Longest completion.
      temperature: Sampling temperature; the loss divides the logits by the same value.
      top_k, top_p, min_p: Optional restrictions of the sampled distribution (vLLM's
        meanings); the loss and the log-prob passes take the same ones (``loss.truncation``;
        on a mesh without a vocab axis of size > 1).
    """

    KEY = "rollout"

    batch_size: int = 8
    num_generations: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def validate(self, key: str) -> None:
        positive(f"{key}.batch_size", self.batch_size)
        positive(f"{key}.num_generations", self.num_generations)
        if self.num_generations < 2:
            fail(f"{key}.num_generations", "must be >= 2 (a group of one has no advantage)")
        if self.batch_size % self.num_generations:
            fail(f"{key}.batch_size", f"{self.batch_size} is not divisible by "
                  f"rollout.num_generations={self.num_generations}")
        positive(f"{key}.max_new_tokens", self.max_new_tokens)
        finite(f"{key}.temperature", self.temperature)
        if self.temperature <= 0:
            fail(f"{key}.temperature", f"must be > 0 for GRPO sampling, got {self.temperature}")
        try:
            check_sampler_truncation(self.top_k, self.top_p, self.min_p)
        except ValueError as e:  # its message starts with the option's name
            fail(f"{key}.{str(e).split()[0]}", str(e))


@dataclasses.dataclass(frozen=True)
class OptimSection(Section):
    """optax AdamW with global-norm clipping and a warmup-cosine learning rate.

    The rate rises linearly from 0 to ``learning_rate`` over ``warmup_steps`` optimizer
    updates, then follows a cosine down to ``learning_rate * end_lr_ratio`` at the last update.
    """

    KEY = "optim"

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
            finite(f"{key}.{name}", getattr(self, name))
        if self.learning_rate <= 0:
            fail(f"{key}.learning_rate", f"must be > 0, got {self.learning_rate}")
        if self.max_grad_norm <= 0:
            fail(f"{key}.max_grad_norm", f"must be > 0, got {self.max_grad_norm}")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                fail(f"{key}.{name}", f"must be in [0, 1), got {getattr(self, name)}")
        if self.warmup_steps < 0:
            fail(f"{key}.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.end_lr_ratio <= 1:
            fail(f"{key}.end_lr_ratio", f"must be in [0, 1], got {self.end_lr_ratio}")


@dataclasses.dataclass(frozen=True)
class TrainSection(Section):
    """The loop.

    Attributes:
      steps: Training steps (each: one rollout, ``ppo_epochs`` optimizer updates).
      micro_batch_size: Rows per forward/backward; gradients accumulate over
        ``batch_size / micro_batch_size`` micro-batches as TRL 1.16 accumulates over its
        steps (docs/loss.md, "In the trainer").
      ppo_epochs: Optimizer updates per rollout; the ratio's old log-probs come from the
        policy before the first update.
      run_dir: Where metrics, checkpoints, W&B files and reports go.
      checkpoint_every: Save an Orbax checkpoint every this many steps (and at the end).
      keep_checkpoints: How many checkpoints to keep.
      max_skipped_steps: A step whose loss or gradient is not finite applies no update (the
        parameters and optimizer state stay as they were) and is logged as skipped; this many
        skipped steps in a row stop the run with an error.
    """

    KEY = "train"

    steps: int = 100
    micro_batch_size: int = 8
    ppo_epochs: int = 1
    run_dir: str = "runs/default"
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    max_skipped_steps: int = 3

    def validate(self, key: str) -> None:
        for name in ("steps", "micro_batch_size", "ppo_epochs", "checkpoint_every",
                     "keep_checkpoints", "max_skipped_steps"):
            positive(f"{key}.{name}", getattr(self, name))
        if not self.run_dir:
            fail(f"{key}.run_dir", "must name a directory")


@dataclasses.dataclass(frozen=True)
class LossSection(Section):
    """Which loss, and the GRPOLossConfig fields (but ``temperature``,
    ``max_completion_length`` and the truncation, which come from ``rollout``).

    Attributes:
      head: ``logits`` (the model's float32 logits ``[B, T, V]``, then the logits-level loss)
        or ``fused`` (hidden states + head weights; no ``[B, T, V]`` array).
      impl: ``auto`` (the measured best on this backend), ``reference`` (materialised float32
        log-softmax: the baseline), ``xla`` or ``pallas``.
      options: GRPOLossConfig fields (``loss_type``, ``beta``, ``epsilon_low``, ...).
      kernel: Options of the implementations, keyed by arm (``logits-pallas: {alias_logits:
        true}``): the fields of that op's option dataclass (:mod:`grpo_kernels.rl.kernel`).
      logits_dtype: The dtype the logits are rounded to before the loss, either head:
        ``float32`` (the head's float32 accumulator, kept) or ``bfloat16`` (rounded once, as a
        bf16 model's head in tunix; the loss's statistics stay float32).
      truncation: ``true``: the loss and the log-prob passes take ``rollout.top_k / top_p /
        min_p``, the distribution the sampler drew from; ``false``: the whole vocabulary (the
        biased ratio a trainer gets when it ignores the sampler's truncation).
    """

    KEY = "loss"
    head: str = "logits"
    impl: str = "reference"
    options: dict = dataclasses.field(default_factory=dict)
    kernel: dict = dataclasses.field(default_factory=dict)
    logits_dtype: str = "float32"
    truncation: bool = True

    def validate(self, key: str) -> None:
        if not isinstance(self.truncation, bool):
            fail(f"{key}.truncation", f"must be true or false, got {self.truncation!r}")
        if self.impl == "lm_head_fused":
            fail(f"{key}.impl", "'lm_head_fused' is now two keys: loss.head: fused and "
                 "loss.impl: xla (or auto | reference | pallas)")
        choice(f"{key}.head", self.head, LOSS_HEADS)
        choice(f"{key}.impl", self.impl, LOSS_IMPLS)
        choice(f"{key}.logits_dtype", self.logits_dtype, DTYPE_CHOICES)
        if self.options.get("loss_agg_mode") is not None:
            # policy.micro_scale weights micro-batches by rows or tokens; tunix's aggregations
            # count non-empty rows, which it does not know yet.
            fail(f"{key}.options.loss_agg_mode", "is not supported by this trainer's "
                 "micro-batch accumulation yet; choose the aggregation with loss_type")
        for arm, values in self.kernel.items():
            build_options(f"{key}.kernel", arm, values)

    @property
    def arm(self) -> str:
        """``head-impl``: the name of this choice in an A/B run and its run directory."""
        return f"{self.head}-{self.impl}"


@dataclasses.dataclass(frozen=True)
class EvalSection(Section):
    """Held-out greedy accuracy of the policy before the first step and after the last.

    Attributes:
      num_problems: Held-out problems to score (0: no evaluation). The trainer writes them to
        ``eval_problems.jsonl`` in the run directory and the results to ``eval_before.json`` and
        ``eval_after.json`` (with each problem's 0/1 score, for paired comparisons).
      path: A GSM8K jsonl file to take them from (e.g. the test split); by default, arithmetic
        problems of ``data.difficulty`` from a random stream the training pool never draws
        from, without any question the pool holds (:func:`grpo_kernels.rl.data.
        held_out_problems`).
      max_new_tokens: Longest greedy completion (default: ``rollout.max_new_tokens``).
      batch_size: Prompts per generation call.
    """

    KEY = "eval"

    num_problems: int = 0
    path: str | None = None
    max_new_tokens: int | None = None
    batch_size: int = 32

    def validate(self, key: str) -> None:
        if (not isinstance(self.num_problems, int) or isinstance(self.num_problems, bool)
                or self.num_problems < 0):
            fail(f"{key}.num_problems", f"must be an int >= 0, got {self.num_problems!r}")
        positive(f"{key}.max_new_tokens", self.max_new_tokens, allow_none=True)
        positive(f"{key}.batch_size", self.batch_size)


@dataclasses.dataclass(frozen=True)
class MeshSection(Section):
    """Optional device mesh for the loss: ``shape`` maps axis names to sizes
    (``{dp: 2, tp: 4}``); ``batch_axes`` shard rows, ``vocab_axis`` the vocabulary."""

    KEY = "mesh"

    shape: dict | None = None
    batch_axes: tuple[str, ...] = ("dp",)
    vocab_axis: str | None = None

    def validate(self, key: str) -> None:
        if self.shape is None:
            return
        for name, size in self.shape.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                fail(f"{key}.shape.{name}", f"must be an int >= 1, got {size!r}")
        for axis in (*self.batch_axes, *([self.vocab_axis] if self.vocab_axis else [])):
            if axis not in self.shape:
                fail(f"{key}", f"axis {axis!r} is not in mesh.shape {dict(self.shape)}")


@dataclasses.dataclass(frozen=True)
class LoggingSection(Section):
    """Metrics: JSONL always; W&B ``disabled`` | ``offline`` (files in the run dir) |
    ``online``."""

    KEY = "logging"

    wandb_mode: str = "offline"
    wandb_project: str = "grpo-kernels"
    run_name: str | None = None

    def validate(self, key: str) -> None:
        choice(f"{key}.wandb_mode", self.wandb_mode, WANDB_MODES)
