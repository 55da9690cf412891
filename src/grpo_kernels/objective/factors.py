r"""Per-token factors that TRL's newer options put on the GRPO loss, on ``[B, T]`` arrays.

None of them carries a gradient (TRL computes each without one): they multiply the policy term
(:func:`sampler_ratio`, :func:`off_policy_mask`, :func:`entropy_mask`), replace its ratio
(:func:`vespo_weights`) or weight the entropy bonus (:func:`entropy_weights`).
:mod:`grpo_kernels.objective` combines them; every implementation reaches them through it.
Notation as there: mask :math:`m`, :math:`n_b = \sum_t m_{bt}`, advantages :math:`A_b`.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from grpo_kernels.config import GRPOLossConfig

Array = jax.Array
_sg = jax.lax.stop_gradient
_LOG_1E8 = math.log(1e-8)


def _f32(x: Any) -> Array:
    return jnp.asarray(x, jnp.float32)


def sampler_ratio(old_logp: Array, sampler_logps: Array, mask: Array,
                  config: GRPOLossConfig) -> Array:
    r"""The sampler-mismatch weight :math:`\rho` of ``config.sampler_correction`` (TRL's
    ``vllm_importance_sampling_correction``), without gradient.

    With :math:`d_{bt} = (\log\pi_{old} - \log\pi_{sampler})\,m_{bt}`:
    ``token_*`` :math:`\rho_{bt} = e^{d_{bt}}`; ``sequence_*``
    :math:`\rho_b = e^{\sum_t d_{bt}}` (shape ``[B, 1]``). ``*_truncate`` clips
    :math:`\rho` to ``[sampler_correction_min, sampler_correction_max]`` (a ``None`` bound is
    open); ``*_mask`` sets it to 0 outside that range.
    """
    mode = config.sampler_correction
    d = (_f32(old_logp) - _f32(sampler_logps)) * _f32(mask)
    if mode.startswith("sequence"):
        d = jnp.sum(d, axis=-1, keepdims=True)
    rho = jnp.exp(d)
    low, high = config.sampler_correction_min, config.sampler_correction_max
    if mode.endswith("truncate"):
        rho = jnp.clip(rho, low, high)
    else:
        keep = jnp.ones(rho.shape, bool)
        if low is not None:
            keep = keep & (rho >= low)
        if high is not None:
            keep = keep & (rho <= high)
        rho = jnp.where(keep, rho, jnp.zeros_like(rho))  # not a literal: see terms._choose
    return _sg(rho)


def off_policy_mask(logp: Array, behaviour_logp: Array, mask: Array, advantages: Array,
                    threshold: float) -> Array:
    r"""TRL's off-policy sequence mask (DeepSeek-V3.2), ``[B, 1]`` in {0, 1}:

    .. math:: k_b = \frac{\sum_t m_{bt}(\log\pi_{beh} - \mathrm{sg}(\log\pi))_{bt}}
                         {\max(n_b, 1)}, \qquad \text{keep}_b = [A_b \ge 0] \lor [k_b \le \delta]

    ``behaviour_logp``: the sampler's log-probs when given, else the old policy's.
    ``advantages``: ``[B, 1]``.
    """
    mask = _f32(mask)
    kl = (_f32(behaviour_logp) - _sg(_f32(logp))) * mask
    avg = jnp.sum(kl, axis=-1, keepdims=True) / jnp.maximum(
        jnp.sum(mask, axis=-1, keepdims=True), 1.0)
    return ((_f32(advantages) >= 0) | (avg <= threshold)).astype(jnp.float32)


def _quantile_position(n: Array, q: float) -> tuple[Array, Array, Array]:
    """``(pos, lo, last)``: where the ``q`` quantile of ``n`` sorted values falls (``pos``,
    float32), the index below it and the last index."""
    last = jnp.maximum(n - 1, 0)
    pos = q * last.astype(jnp.float32)
    return pos, jnp.minimum(jnp.floor(pos).astype(jnp.int32), last), last


def distinct_selection_count(mask: Array, rho: float) -> Array:
    """How many of the masked tokens :func:`entropy_mask` selects when their entropies are
    distinct: those at or above the ``1 - rho`` quantile, ``n - lo`` when it falls on a value,
    ``n - lo - 1`` between two (float32)."""
    n = jnp.sum((_f32(mask) > 0).astype(jnp.int32))
    pos, lo, _ = _quantile_position(n, 1.0 - rho)
    return (n - lo - (pos > lo.astype(jnp.float32)).astype(jnp.int32)).astype(jnp.float32)


def masked_quantile(values: Array, mask: Array, q: float,
                    batch_gather: Callable[[Array], Array]) -> tuple[Array, Array]:
    """``(quantile, count)``: the ``q`` quantile (linear interpolation, as ``torch.quantile``)
    of ``values`` where ``mask`` is set, over the whole batch (``batch_gather``), and how many
    values entered; the quantile is 0 when none did."""
    v = batch_gather(_sg(_f32(values))).reshape(-1)
    m = batch_gather(_f32(mask)).reshape(-1) > 0
    n = jnp.sum(m.astype(jnp.int32))
    ordered = jnp.sort(jnp.where(m, v, jnp.inf))
    pos, lo, last = _quantile_position(n, q)
    hi = jnp.minimum(lo + 1, last)
    a, b = ordered[lo], ordered[hi]
    value = a + (pos - lo.astype(jnp.float32)) * (b - a)
    return jnp.where(n > 0, value, 0.0), n


def entropy_mask(entropy: Array, mask: Array, config: GRPOLossConfig,
                 batch_gather: Callable[[Array], Array]) -> Array:
    r"""TRL's high-entropy token selection (``top_entropy_quantile`` :math:`\rho`), ``[B, T]``
    in {0, 1}: :math:`m_{bt}\,[H_{bt} \ge q_{1-\rho}]`, with :math:`q` the quantile of the
    masked entropies of the whole batch (:func:`masked_quantile`); all zero without tokens."""
    threshold, n = masked_quantile(entropy, mask, 1.0 - config.top_entropy_quantile,
                                   batch_gather)
    return select_at(entropy, mask, threshold) * (n > 0).astype(jnp.float32)


def select_at(entropy: Array, mask: Array, threshold: Array) -> Array:
    r""":math:`m\,[H \ge \text{threshold}]` in {0, 1}, without gradient: the selection rule of
    :func:`entropy_mask` at a given threshold."""
    return ((_sg(_f32(entropy)) >= threshold) & (_f32(mask) > 0)).astype(jnp.float32)


def vespo_weights(log_ratio: Array, mask: Array, advantages: Array, config: GRPOLossConfig,
                  rho: Array | None = None) -> Array:
    r"""VESPO's gamma weight :math:`\phi_b` (TRL's ``get_gamma_weights``), ``[B, 1]``, without
    gradient:

    .. math::

        \log w_b &= \mathrm{clip}\Big(\textstyle\sum_t m_{bt}\,\mathrm{clip}(r_{bt}, \pm 20)
          + \sum_t \mathrm{clip}(\log\rho_{bt}, \log 10^{-8}, 20),\ \log 10^{-8}, 20\Big) \\
        \phi_b &= e^{\lambda + k \log w_b - \lambda w_b}

    with the per-token log-ratio :math:`r` and :math:`(k, \lambda)` of the sign of
    :math:`A_b` (``A >= 0``: the ``_pos`` pair); a non-finite :math:`\phi` becomes 0. ``rho``:
    the token-level sampler correction, if any, summed over every position as TRL does.
    """
    seq = jnp.sum(jnp.clip(_f32(log_ratio), -20.0, 20.0) * _f32(mask), axis=-1, keepdims=True)
    if rho is not None:
        seq = seq + jnp.sum(jnp.clip(jnp.log(_f32(rho)), _LOG_1E8, 20.0), axis=-1,
                            keepdims=True)
    log_w = jnp.clip(seq, _LOG_1E8, 20.0)
    nonneg = _f32(advantages) >= 0
    k = jnp.where(nonneg, config.vespo_k_pos, config.vespo_k_neg)
    lam = jnp.maximum(jnp.where(nonneg, config.vespo_lambda_pos, config.vespo_lambda_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    return _sg(jnp.where(jnp.isfinite(phi), phi, 0.0))


def entropy_weights(mask: Array, batch_sum: Callable[[Array], Array],
                    selected: Array | None = None) -> Array:
    r"""Weights :math:`u` of the entropy bonus :math:`\sum_{bt} u_{bt} H_{bt}` (TRL 1.16,
    ``GRPOTrainer._compute_loss``): with the tokens of the policy term
    :math:`e = m \cdot \text{selected}`, :math:`u = e / \max(\sum e, 1)`, a masked token mean
    over the whole batch for every loss type. TRL never divides the bonus by a loss type's
    policy normaliser (``num_items_in_batch`` included); under gradient accumulation it
    divides each micro-batch's mean by the accumulation steps, which is the trainer's
    business (:mod:`grpo_kernels.rl.policy`)."""
    mask = _f32(mask)
    eff = mask if selected is None else mask * selected
    count = None if selected is None else batch_sum(jnp.sum(eff))
    return eff / entropy_norm(mask, batch_sum, count)


def entropy_norm(mask: Array, batch_sum: Callable[[Array], Array],
                 count: Array | None = None) -> Array:
    r"""The denominator of :func:`entropy_weights`: :math:`\max(\text{count}, 1)` with
    ``count`` the whole batch's tokens of the policy term (default :math:`\sum m`; with the
    entropy quantile, the selected ones)."""
    return jnp.maximum(batch_sum(jnp.sum(_f32(mask))) if count is None else count, 1.0)
