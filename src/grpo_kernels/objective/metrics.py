"""Metrics reported beside the loss (TRL's definitions), without gradient."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective.base import BatchSum, _f32, _local, advantage_columns

if TYPE_CHECKING:
    from grpo_kernels.objective.batch import TokenBatch

Array = jax.Array


def masked_mean(x: Array, mask: Array, batch_sum: BatchSum = _local) -> Array:
    """``sum(x * mask) / max(sum(mask), 1)``: zero, never NaN, for an all-zero mask."""
    mask = _f32(mask)
    return batch_sum(jnp.sum(_f32(x) * mask)) / jnp.maximum(batch_sum(jnp.sum(mask)), 1.0)


def loss_metrics(
    logp: Array,
    entropy: Array,
    aux: dict[str, Array],
    batch: TokenBatch,
    config: GRPOLossConfig,
    batch_sum: BatchSum = _local,
) -> dict[str, Array]:
    """Metrics reported beside the loss (TRL's definitions), all without gradient.

    Means are over the whole ``batch`` (``batch_sum``, see :data:`BatchSum`):

    - ``logp`` and ``token_entropy``: ``[B, T]`` per-token log-probs of the chosen tokens and
      entropies of ``softmax(z / temperature)``.
    - ``clip_ratio_low``: share with ``coef_1 < 1 - eps_low`` and ``A < 0``;
      ``clip_ratio_high``: ``coef_1 > 1 + eps_high`` and ``A > 0``; ``clip_ratio_region``:
      either. Token level: masked token mean; sequence levels: mean over sequences (with
      packed rows, ``batch.segments``: over the active segments).
    - ``kl``: masked token mean of the per-token KL (0 when no ``ref_logps`` were given).
    - ``entropy``: masked token mean of ``token_entropy``.
    - ``policy_loss`` and ``kl_loss``: the two parts of the loss
      (``loss = policy_loss + beta * kl_loss``, minus the entropy bonus with ``entropy_coef``).
    """
    sg = jax.lax.stop_gradient
    mask, segments = batch.mask, batch.segments
    coef_1 = sg(aux["coef_1"])
    adv = advantage_columns(batch.advantages)
    low = ((coef_1 < 1.0 - config.epsilon_low) & (adv < 0)).astype(jnp.float32)
    high = ((coef_1 > 1.0 + config.epsilon_high) & (adv > 0)).astype(jnp.float32)
    region = jnp.maximum(low, high)
    if config.importance_sampling_level != "token" and segments is not None:
        active = segments.active(mask)
        counts = jnp.maximum(segments.counts(mask), 1.0)

        def clip_mean(x):  # a sequence-level value is one per segment: its tokens' mean
            per_segment = segments.sum(x * _f32(mask)) / counts
            return batch_sum(jnp.sum(per_segment * active)) / jnp.maximum(
                batch_sum(jnp.sum(active)), 1.0)
    elif config.importance_sampling_level != "token":
        def clip_mean(x):
            return batch_sum(jnp.sum(x[:, 0])) / jnp.maximum(batch_sum(_f32(x.shape[0])), 1.0)
    else:
        def clip_mean(x):
            return masked_mean(x, mask, batch_sum)
    kl = aux["kl"]
    return {
        "logp": sg(_f32(logp)),
        "token_entropy": sg(_f32(entropy)),
        "clip_ratio_low": clip_mean(low),
        "clip_ratio_high": clip_mean(high),
        "clip_ratio_region": clip_mean(region),
        "kl": jnp.float32(0.0) if kl is None else masked_mean(sg(kl), mask, batch_sum),
        "entropy": masked_mean(sg(entropy), mask, batch_sum),
        "policy_loss": sg(aux["policy_loss"]),
        "kl_loss": sg(aux["kl_loss"]),
    }
