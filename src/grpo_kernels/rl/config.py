"""``TrainConfig``: the training run's YAML, as frozen dataclasses validated before any work.

Every error names the dotted key (``rollout.num_generations``) and what was expected, so a bad
config fails in the first second, not after the model has loaded.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.ops.core.truncation import Truncation
from grpo_kernels.rl.schema import build, fail, plain, set_dotted
from grpo_kernels.rl.sections_model import ModelSection, RandomModelSection
from grpo_kernels.rl.sections import (
    LOSS_HEADS,
    LOSS_IMPLS,
    DataSection,
    EvalSection,
    LoggingSection,
    LossSection,
    MeshSection,
    OptimSection,
    RewardFunction,
    RewardsSection,
    RolloutSection,
    TrainSection,
)

# GRPOLossConfig fields the trainer sets itself: the loss sees the sampling temperature and
# truncation (the distribution the sampler drew from), and dr_grpo's length is the rollout's
# max_new_tokens.
DERIVED_LOSS_FIELDS = ("temperature", "max_completion_length", "top_k", "top_p", "min_p")


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
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    logging: LoggingSection = dataclasses.field(default_factory=LoggingSection)

    def __post_init__(self) -> None:  # each section validated itself; now what joins them
        if self.rollout.batch_size % self.train.micro_batch_size:
            fail("train.micro_batch_size", f"{self.train.micro_batch_size} does not divide "
                 f"rollout.batch_size={self.rollout.batch_size}")
        self.loss_config()  # GRPOLossConfig's own checks, reported under loss.options
        if self.mesh.shape is not None:
            shards = math.prod(self.mesh.shape[a] for a in self.mesh.batch_axes)
            if self.train.micro_batch_size % shards:
                fail("train.micro_batch_size", f"{self.train.micro_batch_size} is not "
                     f"divisible by the {shards} batch shards of mesh {dict(self.mesh.shape)}")
            self._check_truncation_on_mesh()

    def _check_truncation_on_mesh(self) -> None:
        """The sharded ops truncate only where each device holds whole vocabulary rows
        (:mod:`grpo_kernels.sharding.truncation`): a vocab axis of size > 1 and a sampler's
        truncation the loss would take is an error, not a silent whole-vocabulary ratio."""
        r, axis = self.rollout, self.mesh.vocab_axis
        truncates = Truncation(r.top_k, r.top_p, r.min_p).active(math.inf)
        if axis and self.mesh.shape[axis] > 1 and truncates and self.loss.truncation:
            fail("mesh.vocab_axis", f"{axis!r} splits the vocabulary over "
                 f"{self.mesh.shape[axis]} devices, but the sampler's truncation "
                 f"(rollout.top_k / top_p / min_p) needs whole rows on each device; drop the "
                 f"vocab axis or set loss.truncation: false (the whole vocabulary's log-probs)")

    def loss_config(self) -> GRPOLossConfig:
        """The GRPOLossConfig of ``loss.options`` with the rollout's temperature, length and
        (with ``loss.truncation``) truncation."""
        options = dict(self.loss.options)
        for name in DERIVED_LOSS_FIELDS:
            if name in options:
                fail(f"loss.options.{name}", "is set by the trainer (rollout.temperature, "
                     "rollout.max_new_tokens, rollout.top_k / top_p / min_p); remove it")
        r = self.rollout
        trunc = {} if not self.loss.truncation else dict(top_k=r.top_k, top_p=r.top_p,
                                                         min_p=r.min_p)
        try:
            return GRPOLossConfig.from_dict({
                **options, "temperature": float(r.temperature),
                "max_completion_length": r.max_new_tokens, **trunc})
        except (ValueError, TypeError) as e:
            raise ValueError(f"loss.options: {e}") from None

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "TrainConfig":
        """Builds and validates a config; ValueError names the first bad key."""
        return build(cls, values, "")

    def to_dict(self) -> dict[str, Any]:
        return plain(self)

    def replace(self, **overrides: Any) -> "TrainConfig":
        """A copy with dotted-key overrides (``{"train.steps": 10}``), validated again."""
        values = self.to_dict()
        for dotted, value in overrides.items():
            set_dotted(values, dotted, value)
        return TrainConfig.from_dict(values)


__all__ = ["LOSS_HEADS", "LOSS_IMPLS", "TrainConfig", "RandomModelSection", "ModelSection",
           "DataSection", "EvalSection", "RewardsSection", "RewardFunction",
           "RolloutSection", "OptimSection", "TrainSection", "LossSection", "MeshSection",
           "LoggingSection", "set_dotted"]
