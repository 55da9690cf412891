"""Loss configuration: one frozen, validated dataclass shared by every implementation."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Mapping

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo"]
ImportanceSamplingLevel = Literal["token", "sequence", "sequence_token"]
KlEstimator = Literal["k3", "k1", "k2"]

LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo",
                               "luspo")
# TRL's original four: the loss types of the gradcheck grid's loss_type x delta product.
CLASSIC_LOSS_TYPES: tuple[str, ...] = LOSS_TYPES[:4]
# Loss types whose per-token policy term is PPO's clipped surrogate (the clip options apply).
CLIPPED_LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# Loss types TRL normalises by num_items_in_batch (dapo's rule); never the entropy bonus.
NUM_ITEMS_LOSS_TYPES: tuple[str, ...] = ("dapo", "cispo", "vespo")
# TRL's vllm_importance_sampling_mode values.
SAMPLER_CORRECTIONS: tuple[str, ...] = ("token_truncate", "token_mask", "sequence_truncate",
                                        "sequence_mask")
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


def _finite(name: str, value: Any) -> None:
    _require(_is_real(value) and math.isfinite(value),
             f"{name} must be a finite number, got {value!r}")


def _optional_finite(name: str, value: Any) -> None:
    _require(value is None or (_is_real(value) and math.isfinite(value)),
             f"{name} must be None or a finite number, got {value!r}")


def _optional_positive(name: str, value: Any, above: float = 0.0) -> None:
    _require(
        value is None or (_is_real(value) and math.isfinite(value) and value > above),
        f"{name} must be None or a finite number > {above:g}, got {value!r}",
    )


def check_sampler_truncation(top_k: Any, top_p: Any, min_p: Any) -> None:
    """ValueError naming the option unless ``top_k`` is None or an int >= 1, ``top_p`` None or
    in ``(0, 1]`` and ``min_p`` None or in ``[0, 1]`` (a sampler's truncation)."""
    _require(top_k is None or (isinstance(top_k, int) and not isinstance(top_k, bool)
                               and top_k >= 1),
             f"top_k must be None or an int >= 1, got {top_k!r}")
    for name, x, low_open in (("top_p", top_p, True), ("min_p", min_p, False)):
        ok = x is None or (_is_real(x) and math.isfinite(x) and (0 < x if low_open else 0 <= x)
                           and x <= 1)
        _require(ok, f"{name} must be None or a number in {'(0, 1]' if low_open else '[0, 1]'}"
                 f", got {x!r}")


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
      loss_agg_norm: tunix's ``norm`` of two aggregations, ``None`` for their defaults: the
        divisor of each sequence's sum in ``sequence-mean-token-scale`` (default: the
        completion length ``T``; required with packed rows) and of the whole sum in
        ``sequence-mean-token-sum-norm`` (default: the non-empty sequences). Ignored by the
        other aggregations; needs ``loss_agg_mode``.
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
      sapo_temperature_pos: SAPO's gate temperature for tokens with ``A > 0`` (TRL default 1.0).
      sapo_temperature_neg: SAPO's gate temperature for ``A <= 0`` (TRL default 1.05).
      vespo_k_pos, vespo_lambda_pos: VESPO's gamma weight :math:`\phi(w) = e^{\lambda} w^k
        e^{-\lambda w}` for ``A >= 0`` (TRL defaults 2 and 3).
      vespo_k_neg, vespo_lambda_neg: The same for ``A < 0`` (TRL defaults 3 and 2).
      sampler_correction: Correction for the mismatch between the sampler's log-probs (call
        argument ``sampler_logps``) and the old policy's: ``None`` (off), ``token_truncate``,
        ``token_mask``, ``sequence_truncate`` or ``sequence_mask`` (TRL's
        ``vllm_importance_sampling_mode``; see
        :func:`grpo_kernels.objective.factors.sampler_ratio`).
      sampler_correction_min: Lower bound ``C_min`` of the correction's ratio, or ``None``.
      sampler_correction_max: Upper bound ``C_max`` (TRL default 3.0), or ``None``.
      off_policy_mask_threshold: TRL's off-policy sequence mask: a sequence keeps its policy
        term when ``A >= 0`` or its masked mean of ``sampler - logp`` is at most this;
        ``None`` for off.
      kl_bias_correction: Multiply the per-token KL by the unclipped ratio :math:`e^r` (TRL's
        ``use_bias_correction_kl``), with its gradient.
      entropy_coef: The loss minus ``entropy_coef`` times the mean entropy of
        ``softmax(z / temperature)`` over the policy term's tokens (TRL's entropy bonus).
      top_entropy_quantile: :math:`\rho \in (0, 1]`: only tokens whose entropy is at or above
        the :math:`1 - \rho` quantile of the batch's masked tokens carry the policy term
        (TRL); 1 keeps all.
      top_k, top_p, min_p: The sampler's truncation (vLLM's order: min-p, top-k, top-p; None
        for off): the log-probs are those of the distribution it drew from, renormalised over
        the tokens it keeps and the chosen one (:mod:`grpo_kernels.ops.core.truncation`), the
        entropy that distribution's; the metric ``outside_truncation`` counts the unmasked
        tokens it would have dropped. Every implementation, on one device or on a mesh
        that keeps rows whole (:mod:`grpo_kernels.sharding.truncation`).
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
    loss_agg_norm: float | None = None
    kl_estimator: KlEstimator = "k3"
    kl_clamp: float | None = None
    dual_clip: float | None = None
    log_ratio_clamp: float | None = None
    sequence_log_ratio_max: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    sampler_correction: str | None = None
    sampler_correction_min: float | None = None
    sampler_correction_max: float | None = 3.0
    off_policy_mask_threshold: float | None = None
    kl_bias_correction: bool = False
    entropy_coef: float = 0.0
    top_entropy_quantile: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

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
        _optional_positive("loss_agg_norm", self.loss_agg_norm)
        _require(self.loss_agg_norm is None or self.loss_agg_mode is not None,
                 "loss_agg_norm is tunix's norm of a loss_agg_mode; set loss_agg_mode too "
                 f"(loss_agg_norm={self.loss_agg_norm!r}, loss_agg_mode=None)")
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
        self._check_loss_family()
        check_sampler_truncation(self.top_k, self.top_p, self.min_p)
        self._check_sampler_options()
        self._check_entropy_options()

    def _check_loss_family(self) -> None:
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            value = getattr(self, name)
            _finite(name, value)
            _require(value > 0, f"{name} must be > 0, got {value}")
        for name in ("vespo_k_pos", "vespo_k_neg"):
            value = getattr(self, name)
            _finite(name, value)
            _require(value >= 0, f"{name} must be >= 0, got {value}")
        for name in ("vespo_lambda_pos", "vespo_lambda_neg"):
            value = getattr(self, name)
            _finite(name, value)
            _require(value > 0, f"{name} must be > 0, got {value}")
        if self.loss_type not in CLIPPED_LOSS_TYPES:
            for name in ("delta", "dual_clip"):
                _require(getattr(self, name) is None,
                         f"{name} applies to the clipped loss types {CLIPPED_LOSS_TYPES}; "
                         f"set it to None for loss_type={self.loss_type!r}")

    def _check_sampler_options(self) -> None:
        mode = self.sampler_correction
        _require(mode is None or mode in SAMPLER_CORRECTIONS,
                 f"sampler_correction must be None or one of {SAMPLER_CORRECTIONS}, got {mode!r}")
        for name in ("sampler_correction_min", "sampler_correction_max",
                     "off_policy_mask_threshold"):
            _optional_finite(name, getattr(self, name))
        low, high = self.sampler_correction_min, self.sampler_correction_max
        _require(low is None or high is None or low < high,
                 f"sampler_correction_min must be < sampler_correction_max, got {low} >= {high}")
        _require(low is None or low >= 0,
                 f"sampler_correction_min must be None or >= 0 (a ratio), got {low}")
        if mode is not None and mode.endswith("truncate"):
            _require(low is not None or high is not None,
                     f"sampler_correction={mode!r} needs sampler_correction_min or "
                     "sampler_correction_max (a truncation needs a bound), got both None")
        if self.loss_type == "vespo" and mode is not None:
            _require(mode.startswith("token"),
                     "loss_type='vespo' folds a per-token sampler correction into its weight: "
                     "sampler_correction must be None, 'token_truncate' or 'token_mask', "
                     f"got {mode!r}")
        _require(isinstance(self.kl_bias_correction, bool),
                 f"kl_bias_correction must be True or False, got {self.kl_bias_correction!r}")

    def _check_entropy_options(self) -> None:
        _finite("entropy_coef", self.entropy_coef)
        rho = self.top_entropy_quantile
        _require(_is_real(rho) and math.isfinite(rho) and 0 < rho <= 1,
                 f"top_entropy_quantile must be a number in (0, 1], got {rho!r}")

    @property
    def has_entropy_bonus(self) -> bool:
        """Whether the loss depends on the entropy's value (``entropy_coef != 0``); the
        quantile's mask alone carries no gradient."""
        return self.entropy_coef != 0

    @property
    def needs_sampler_logps(self) -> bool:
        """Whether a call must pass ``sampler_logps`` (a sampler correction is on)."""
        return self.sampler_correction is not None

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
