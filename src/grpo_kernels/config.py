"""Loss configuration: one frozen, validated dataclass shared by every implementation."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Mapping

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ImportanceSamplingLevel = Literal["token", "sequence"]

LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = ("token", "sequence")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class GRPOLossConfig:
    """Options of the GRPO policy loss, with the meaning of Hugging Face TRL's GRPOTrainer.

    Attributes:
      loss_type: Aggregation of per-token losses: ``grpo`` (mean over sequences of the
        per-sequence token mean), ``bnpo`` (token mean over the batch), ``dr_grpo`` (sum over
        ``B * max_completion_length``), ``dapo`` (sum over ``num_items_in_batch``).
      epsilon_low: Lower clip: the ratio is clipped below at ``1 - epsilon_low``.
      epsilon_high: Upper clip: the ratio is clipped above at ``1 + epsilon_high``.
      delta: Optional upper bound on the unclipped ratio (two-sided clipping), ``None`` for off.
      beta: Weight of the k3 KL estimator against the reference policy; ``> 0`` needs
        ``ref_logps`` at call time.
      temperature: Logits are divided by it before the softmax (as in sampling).
      importance_sampling_level: ``token`` (PPO ratio per token) or ``sequence`` (GSPO: the
        masked mean log-ratio of the sequence, broadcast over its tokens).
      max_completion_length: Denominator length of ``dr_grpo``; required for it.
    """

    loss_type: LossType = "grpo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    beta: float = 0.0
    temperature: float = 1.0
    importance_sampling_level: ImportanceSamplingLevel = "token"
    max_completion_length: int | None = None

    def __post_init__(self) -> None:
        _require(
            self.loss_type in LOSS_TYPES,
            f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}",
        )
        _require(
            self.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS,
            "importance_sampling_level must be one of "
            f"{IMPORTANCE_SAMPLING_LEVELS}, got {self.importance_sampling_level!r}",
        )
        for name in ("epsilon_low", "epsilon_high", "beta", "temperature"):
            value = getattr(self, name)
            _require(
                _is_real(value) and math.isfinite(value),
                f"{name} must be a finite number, got {value!r}",
            )
        _require(self.epsilon_low >= 0, f"epsilon_low must be >= 0, got {self.epsilon_low}")
        _require(self.epsilon_low < 1, f"epsilon_low must be < 1, got {self.epsilon_low}")
        _require(self.epsilon_high >= 0, f"epsilon_high must be >= 0, got {self.epsilon_high}")
        _require(self.beta >= 0, f"beta must be >= 0, got {self.beta}")
        _require(self.temperature > 0, f"temperature must be > 0, got {self.temperature}")
        if self.delta is not None:
            _require(
                _is_real(self.delta) and math.isfinite(self.delta) and self.delta > 0,
                f"delta must be None or a finite number > 0, got {self.delta!r}",
            )
        if self.max_completion_length is not None:
            _require(
                isinstance(self.max_completion_length, int)
                and not isinstance(self.max_completion_length, bool)
                and self.max_completion_length > 0,
                "max_completion_length must be None or an int > 0, "
                f"got {self.max_completion_length!r}",
            )
        _require(
            self.loss_type != "dr_grpo" or self.max_completion_length is not None,
            "loss_type='dr_grpo' needs max_completion_length (an int > 0), got None",
        )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "GRPOLossConfig":
        """Builds a config from a mapping (e.g. parsed YAML), rejecting unknown keys by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        _require(
            not unknown,
            f"unknown GRPOLossConfig key(s) {unknown}; known keys are {sorted(known)}",
        )
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
