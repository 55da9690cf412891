"""Loss configuration: one frozen, validated dataclass shared by every implementation."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Mapping

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ImportanceSamplingLevel = Literal["token", "sequence", "sequence_token"]
KlEstimator = Literal["k3", "k1", "k2"]

LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = ("token", "sequence", "sequence_token")
KL_ESTIMATORS: tuple[str, ...] = ("k3", "k1", "k2")
# tunix's loss_agg_mode spellings (tunix/rl/common.py: aggregate_loss), with its meanings.
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "sequence-mean-token-mean",
                                   "sequence-mean-token-scale", "seq-mean-token-sum",
                                   "sequence-mean-token-sum-norm")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _optional_positive(name: str, value: Any, above: float = 0.0) -> None:
    _require(
        value is None or (_is_real(value) and math.isfinite(value) and value > above),
        f"{name} must be None or a finite number > {above:g}, got {value!r}",
    )


@dataclasses.dataclass(frozen=True)
class GRPOLossConfig:
    r"""Options of the GRPO policy loss, with the meaning of Hugging Face TRL's GRPOTrainer.

    Attributes:
      loss_type: Aggregation of per-token losses: ``grpo`` (mean over sequences of the
        per-sequence token mean), ``bnpo`` (token mean over the batch), ``dr_grpo`` (sum over
        ``B * max_completion_length``), ``dapo`` (sum over ``num_items_in_batch``).
      epsilon_low: Lower clip: the ratio is clipped below at ``1 - epsilon_low``.
      epsilon_high: Upper clip: the ratio is clipped above at ``1 + epsilon_high``.
      delta: Optional upper bound on the unclipped ratio (two-sided clipping), ``None`` for off.
      beta: Weight of the KL estimator against the reference policy; ``> 0`` needs
        ``ref_logps`` at call time.
      temperature: Logits are divided by it before the softmax (as in sampling).
      importance_sampling_level: ``token`` (PPO ratio per token), ``sequence`` (GSPO: the
        masked mean log-ratio of the sequence, broadcast over its tokens, differentiated as a
        mean) or ``sequence_token`` (GSPO-token, tunix's ``loss_algo="gspo-token"``: the same
        value, but each token's ratio is differentiated w.r.t. its own log-prob only).
      max_completion_length: Denominator length of ``dr_grpo``; required for it.
      loss_agg_mode: ``None``: the ``loss_type``'s aggregation (TRL). Otherwise one of tunix's
        five aggregations, which replaces it (see
        :func:`grpo_kernels.objective.token_weights`).
      kl_estimator: With :math:`d = \log\pi_{ref} - \log\pi`: ``k3`` (default,
        :math:`e^d - d - 1`; tunix's ``low_var_kl``), ``k1`` (:math:`-d`; tunix's ``kl``) or
        ``k2`` (:math:`d^2 / 2`; tunix's ``mse_kl``).
      kl_clamp: Optional symmetric clamp of the per-token KL to ``[-kl_clamp, kl_clamp]``
        (tunix's ``kl_clamp_value``); ``None`` for off.
      dual_clip: Optional dual-clip constant :math:`c > 1` (tunix's ``epsilon_c``): for
        :math:`A < 0` the per-token policy loss is capped at :math:`-c A`.
      log_ratio_clamp: Optional symmetric clamp of each token's log-ratio
        :math:`\log\pi - \log\pi_{old}` before anything else uses it (tunix clamps at 20).
      sequence_log_ratio_max: Optional upper cap on the sequence log-ratio of the two sequence
        levels (tunix's gspo-token caps at 10); ignored at token level.
    """

    loss_type: LossType = "grpo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    beta: float = 0.0
    temperature: float = 1.0
    importance_sampling_level: ImportanceSamplingLevel = "token"
    max_completion_length: int | None = None
    loss_agg_mode: str | None = None
    kl_estimator: KlEstimator = "k3"
    kl_clamp: float | None = None
    dual_clip: float | None = None
    log_ratio_clamp: float | None = None
    sequence_log_ratio_max: float | None = None

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
        for name in ("delta", "kl_clamp", "log_ratio_clamp"):
            _optional_positive(name, getattr(self, name))
        _optional_positive("dual_clip", self.dual_clip, above=1.0)
        if self.sequence_log_ratio_max is not None:
            value = self.sequence_log_ratio_max
            _require(_is_real(value) and math.isfinite(value),
                     f"sequence_log_ratio_max must be None or a finite number, got {value!r}")
        _require(
            self.loss_agg_mode is None or self.loss_agg_mode in LOSS_AGG_MODES,
            f"loss_agg_mode must be None or one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}",
        )
        _require(
            self.kl_estimator in KL_ESTIMATORS,
            f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}",
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
