"""tunix's ``GRPOConfig`` read into our :class:`~grpo_kernels.GRPOLossConfig`."""

from __future__ import annotations

from typing import Any

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.integrations.tunix import offers

# tunix's kl_loss_mode -> our kl_estimator (tunix/rl/common.py: compute_kl_divergence).
KL_MODES: dict[str, str] = {"kl": "k1", "mse_kl": "k2", "low_var_kl": "k3"}
LOSS_ALGOS: tuple[str, ...] = ("grpo", "gspo-token")
# The constants of tunix's grpo_loss_fn: the per-token log-ratio clamp and gspo-token's cap.
TUNIX_LOG_RATIO_CLAMP = 20.0
TUNIX_GSPO_TOKEN_MAX = 10.0
# The sampler's truncation, read from the algorithm config where set (follow_sampler).
TRUNCATION_FIELDS: tuple[str, ...] = ("top_k", "top_p", "min_p")


def field(algo_config: Any, name: str, default: Any = None) -> Any:
    """``algo_config.name``, or ``default`` where it has no such field."""
    return getattr(algo_config, name, default)


def loss_config(algo_config: Any, has_ref: bool, shape: tuple[int, int] | None = None,
                packed: bool = False) -> GRPOLossConfig:
    """Our :class:`GRPOLossConfig` for a tunix ``GRPOConfig`` (any object with its fields).

    Read: ``epsilon``, ``epsilon_high`` (absent or ``None``: ``epsilon``), ``epsilon_c`` (the
    dual clip), ``beta`` (applied only with reference log-probs, as tunix), ``kl_loss_mode``,
    ``kl_clamp_value``, ``loss_agg_mode``, ``loss_algo``, ``temperature`` (0 and 1 leave the
    logits alone, as tunix) and, where they are set (tunix's ``GRPOConfig`` has no such fields:
    :func:`~grpo_kernels.integrations.tunix.follow_sampler` sets them from its rollout
    config), the sampler's truncation ``top_k``, ``top_p`` and ``min_p``. The log-ratio clamp
    (20) and gspo-token's cap (10) are tunix's.
    Given the ``TrainExample``'s ``shape`` (``[B, T]`` of its completion arrays), tunix's
    defaults of its aggregations' ``norm`` become our ``loss_agg_norm`` where they are not
    ours: ``B`` for an unpacked ``sequence-mean-token-sum-norm`` where the installed tunix
    divides by the rows (:func:`~grpo_kernels.integrations.tunix.offers.sum_norm_by_rows`),
    and for ``packed`` rows aggregated per row (0.1.7) the row's whole length in
    ``sequence-mean-token-scale`` (our loss scores one position fewer:
    :mod:`~grpo_kernels.integrations.tunix.inputs`).

    Raises:
      ValueError: naming the ``GRPOConfig`` field whose value we do not support.
    """
    epsilon = field(algo_config, "epsilon", 0.2)
    epsilon_high = field(algo_config, "epsilon_high")
    epsilon_c = field(algo_config, "epsilon_c")
    beta = field(algo_config, "beta", 0.0) or 0.0
    kl_mode = field(algo_config, "kl_loss_mode", "kl")
    loss_algo = field(algo_config, "loss_algo", "grpo")
    temperature = field(algo_config, "temperature", 1.0)
    agg = field(algo_config, "loss_agg_mode", "sequence-mean-token-mean")
    if kl_mode not in KL_MODES:
        raise ValueError(f"GRPOConfig.kl_loss_mode must be one of {tuple(KL_MODES)}, "
                         f"got {kl_mode!r}")
    if loss_algo not in LOSS_ALGOS:
        raise ValueError(f"GRPOConfig.loss_algo must be one of {LOSS_ALGOS}, got {loss_algo!r}")
    if epsilon_c is not None and not epsilon_c > 1:
        raise ValueError(f"GRPOConfig.epsilon_c (the dual clip) must be None or > 1 for "
                         f"grpo_kernels, got {epsilon_c!r}")
    if beta < 0:
        raise ValueError(f"GRPOConfig.beta must be >= 0 for grpo_kernels, got {beta!r}")
    norm = None
    if shape is not None and agg == "sequence-mean-token-sum-norm" and not packed \
            and offers.sum_norm_by_rows():
        norm = float(shape[0])
    if shape is not None and agg == "sequence-mean-token-scale" and packed \
            and not offers.packs_per_segment():
        norm = float(shape[1])
    fields = dict(
        epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        beta=float(beta) if has_ref else 0.0,
        temperature=1.0 if temperature in (0, 0.0, None) else temperature,
        importance_sampling_level="token" if loss_algo == "grpo" else "sequence_token",
        loss_agg_mode=agg,
        loss_agg_norm=norm,
        kl_estimator=KL_MODES[kl_mode],
        kl_clamp=field(algo_config, "kl_clamp_value"),
        dual_clip=epsilon_c,
        log_ratio_clamp=TUNIX_LOG_RATIO_CLAMP,
        sequence_log_ratio_max=None if loss_algo == "grpo" else TUNIX_GSPO_TOKEN_MAX,
        **{name: field(algo_config, name) for name in TRUNCATION_FIELDS},
    )
    try:
        return GRPOLossConfig(**fields)
    except ValueError as e:  # name the tunix field behind ours
        names = {"epsilon_low": "epsilon", "kl_clamp": "kl_clamp_value",
                 "loss_agg_mode": "loss_agg_mode", "epsilon_high": "epsilon_high",
                 "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                 "min_p": "min_p"}
        for ours, theirs in names.items():
            if str(e).startswith(ours):
                raise ValueError(f"GRPOConfig.{theirs}: {e}") from None
        raise
