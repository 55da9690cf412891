r"""What our losses return to tunix: its own ``grpo_loss_fn``'s outputs, from our metrics.

- tunix 0.1.7: ``(loss, aux)``, ``aux`` a dict of scalars (:func:`tunix_aux`);
- tunix's development head: ``LossOutput(primary_loss, aux_metrics)``
  (:func:`loss_output`). Its trainer differentiates ``primary_loss.unreduced_sum`` and scales
  the gradient by ``1 / denominator``, summing both over micro-batches before dividing, so a
  loss is its sum and its denominator. Ours is the mean :math:`L = \sum_{bt} w_{bt}
  \ell_{bt}`; with tunix's denominator :math:`D` for the batch's mask (its own
  ``aggregate_loss`` says what it is, and its floor) the sum is :math:`L \max(D, d_{min})`,
  which is tunix's sum wherever our weights are its aggregation (:func:`grpo_kernels.
  objective.token_weights`). Every aggregated aux entry is written the same way, and the token
  means as tunix writes them: ``WeightedMetric(sum over masked tokens, token count)``.

Both carry ours beside tunix's entries, under ``grpo_kernels/...``. No gradient flows through
any aux entry.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.integrations.tunix import offers
from grpo_kernels.integrations.tunix.inputs import Example
from grpo_kernels.objective import (advantage_columns, kl_divergence, log_importance_ratio,
                                    token_terms, token_weights)

Array = jax.Array
OURS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "entropy")


def _tunix_mean(x: Array, mask: Array) -> Array:
    """tunix's ``masked_mean``: ``sum(x m) / (sum(m) + 1e-8)``."""
    mask = mask.astype(jnp.float32)
    return jnp.sum(x.astype(jnp.float32) * mask) / (jnp.sum(mask) + 1e-8)


def _token_pieces(metrics: dict[str, Array], ex: Example, config: GRPOLossConfig,
                  epsilon_c: float | None) -> dict[str, Array]:
    """The per-token quantities tunix's aux reads, from our log-probs (no gradient)."""
    sg = jax.lax.stop_gradient
    logp = sg(metrics["logp"])
    mask = ex.mask.astype(jnp.float32)
    old = logp if ex.old_logps is None else ex.old_logps.astype(jnp.float32)
    adv = advantage_columns(ex.advantages)
    ratio_log = log_importance_ratio(logp, old, mask, config, ex.segments)
    terms = token_terms(logp, ratio_log, adv, config)
    pg1, pg2 = -adv * terms["coef_1"], -adv * terms["coef_2"]
    lower = jnp.zeros_like(pg1) if epsilon_c is None else (
        (jnp.maximum(pg1, pg2) > -epsilon_c * adv) & (adv < 0)).astype(jnp.float32)
    return {"logp": logp, "mask": mask, "old": old, "adv": jnp.broadcast_to(adv, mask.shape),
            "ratio_log": ratio_log, "ratio": terms["coef_1"], "pg1": pg1, "pg2": pg2,
            "lower": lower, "weights": token_weights(mask, config, segments=ex.segments),
            "entropy": sg(metrics["token_entropy"])}


def _token_stats(p: dict[str, Array], ex: Example) -> dict[str, Array]:
    """The aux entries both tunix versions define alike: plain masked means and extremes."""
    mask, ratio, adv = p["mask"], p["ratio"], p["adv"]
    on = mask > 0
    out = {
        "is_ratio/mean": _tunix_mean(ratio, mask),
        "is_ratio/max": jnp.max(jnp.where(on, ratio, 0.0)),
        "is_ratio/min": jnp.min(jnp.where(on, ratio, jnp.inf)),
        "log_ratio/abs_mean": _tunix_mean(jnp.abs(p["ratio_log"]), mask),
        "pg_loss/unclipped_mean": _tunix_mean(p["pg1"], mask),
        "pg_loss/clipped_mean": _tunix_mean(p["pg2"], mask),
        "advantage/abs_mean": _tunix_mean(jnp.abs(adv), mask),
        "advantage/max": jnp.max(jnp.where(on, adv, -jnp.inf)),
        "advantage/min": jnp.min(jnp.where(on, adv, jnp.inf)),
        "advantage/nonzero_frac": _tunix_mean((jnp.abs(adv) > 1e-8).astype(jnp.float32), mask),
    }
    if ex.sampler_weights is None:
        out["sampler_is/weight_mean"] = jnp.float32(1.0)
        out["sampler_is/weight_min"] = jnp.float32(1.0)
    else:
        sis = ex.sampler_weights.astype(jnp.float32)
        out["sampler_is/weight_mean"] = _tunix_mean(sis, mask)
        out["sampler_is/weight_min"] = jnp.min(jnp.where(on, sis, jnp.inf))
    return out


def _ours(metrics: dict[str, Array], mask: Array) -> dict[str, Array]:
    """Our entries of the aux: :data:`OURS`, and with a sampler's truncation the share of
    completion tokens outside its kept set (``outside_truncation``)."""
    out = {f"grpo_kernels/{key}": metrics[key] for key in OURS}
    if "outside_truncation" in metrics:
        out["grpo_kernels/outside_truncation"] = metrics["outside_truncation"] / jnp.maximum(
            jnp.sum(mask), 1.0)
    return out


def tunix_aux(metrics: dict[str, Array], ex: Example, config: GRPOLossConfig,
              epsilon_c: float | None) -> dict[str, Array]:
    """The aux dict of tunix 0.1.7's ``grpo_loss_fn`` (same keys, same definitions) from our
    metrics, plus ours under ``grpo_kernels/...``."""
    p = _token_pieces(metrics, ex, config, epsilon_c)
    aux = {
        "kl": metrics["kl"],
        "kl_loss": metrics["kl_loss"],
        "pg_loss": metrics["policy_loss"],
        "pg_clipfrac": _tunix_mean((p["pg2"] > p["pg1"]).astype(jnp.float32), p["mask"]),
        "ppo_kl": _tunix_mean(p["old"] - p["logp"], p["mask"]),
        "pg_clipfrac_lower": jnp.sum(p["weights"] * p["lower"]),
        **_token_stats(p, ex),
        "entropy": jnp.sum(p["weights"] * p["entropy"]),
    }
    return {**aux, **_ours(metrics, p["mask"])}


def _aggregated(ex: Example, mode: str) -> Any:
    """tunix's ``aggregate_loss`` of zeros for this batch's mask: its denominator and floor."""
    from tunix.rl import common

    seg = {} if ex.segments is None else {"segment_ids": ex.segments.ids,
                                          "num_segments": ex.segments.count}
    return common.aggregate_loss(jnp.zeros(ex.mask.shape, jnp.float32), ex.mask, mode, **seg)


def _as_sum(mean: Array, skeleton: Any) -> Any:
    """``WeightedMetric(mean * D', D)`` with tunix's denominator ``D`` of ``skeleton`` and the
    divisor ``D'`` its ``compute`` uses (``D`` plus its ``eps``, floored at ``min_denom``)."""
    denom = jnp.asarray(skeleton.denominator, jnp.float32)
    divisor = denom if skeleton.eps is None else denom + skeleton.eps
    if skeleton.min_denom is not None:
        divisor = jnp.maximum(divisor, skeleton.min_denom)
    return offers.weighted_metric()(mean * jax.lax.stop_gradient(divisor), skeleton.denominator,
                                    eps=skeleton.eps, min_denom=skeleton.min_denom)


def loss_output(loss: Array, metrics: dict[str, Array], ex: Example, config: GRPOLossConfig,
                epsilon_c: float | None) -> Any:
    """The development head's ``LossOutput`` of its ``grpo_loss_fn`` (module docstring): the
    primary loss and every aux entry it logs, with its definition, plus ours."""
    wm = offers.weighted_metric()
    p = _token_pieces(metrics, ex, config, epsilon_c)
    skeleton = _aggregated(ex, config.loss_agg_mode)
    tokens = jnp.sum(ex.mask)  # tunix's token denominator, in the mask's dtype
    sg = jax.lax.stop_gradient
    aux = {
        "kl": wm(jnp.array(0.0), jnp.array(1.0)),
        "kl_loss": wm(jnp.array(0.0), jnp.array(1.0)),
        "reduced_pg_loss": metrics["policy_loss"],
        "unreduced_pg_loss": _as_sum(metrics["policy_loss"], skeleton),
        "pg_clipfrac": wm(jnp.sum((p["pg2"] > p["pg1"]).astype(jnp.float32) * p["mask"]),
                          tokens, min_denom=1.0),
        "ppo_kl": wm(jnp.sum((p["old"] - p["logp"]) * p["mask"]), tokens, min_denom=1.0),
        "pg_clipfrac_lower": _as_sum(jnp.sum(p["weights"] * p["lower"]), skeleton),
        **_token_stats(p, ex),
        "entropy": _as_sum(jnp.sum(p["weights"] * p["entropy"]), skeleton),
    }
    if ex.ref_logps is not None:
        kl = kl_divergence(p["logp"], ex.ref_logps, config)
        aux["kl"] = wm(jnp.sum(kl * p["mask"]), tokens, min_denom=1.0)
        aux["kl_loss"] = _as_sum(sg(metrics["kl_loss"]), skeleton)
    aux.update(_ours(metrics, p["mask"]))
    return offers.loss_output()(primary_loss=_as_sum(loss, skeleton), aux_metrics=aux)


def policy_output(loss: Array, metrics: dict[str, Array], ex: Example, config: GRPOLossConfig,
                  epsilon_c: float | None) -> Any:
    """What the installed tunix's policy losses return (:mod:`.offers`): a ``LossOutput`` or
    ``(loss, aux)``."""
    if offers.loss_output() is not None:
        return loss_output(loss, metrics, ex, config, epsilon_c)
    return loss, tunix_aux(metrics, ex, config, epsilon_c)


def differentiated(output: Any) -> Array:
    """The scalar tunix's trainer differentiates in a policy loss's ``output``: 0.1.7's
    ``loss`` of ``(loss, aux)``, the head's ``primary_loss.unreduced_sum`` of a ``LossOutput``
    (it divides the gradient by the denominator afterwards)."""
    return output[0] if isinstance(output, tuple) else output.primary_loss.unreduced_sum
