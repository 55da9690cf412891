r"""The GRPO objective's terms on per-token log-probabilities ``[B, T]``.

Notation, for sequence ``b`` and position ``t`` with mask :math:`m_{bt} \in \{0, 1\}`:

.. math::

    r_{bt} &= \log\pi(y_{bt}) - \log\pi_{old}(y_{bt})                    && \text{(token level)} \\
    r_{bt} &= \frac{\sum_s m_{bs} (\log\pi(y_{bs}) - \log\pi_{old}(y_{bs}))}
                   {\max(\sum_s m_{bs}, 1)}                               && \text{(sequence level, GSPO)} \\
    c^{(1)}_{bt} &= \min(e^{r_{bt}}, \delta), \quad
    c^{(2)}_{bt} = \mathrm{clip}(e^{r_{bt}}, 1 - \epsilon_{low}, 1 + \epsilon_{high}) \\
    \ell_{bt} &= -\min(c^{(1)}_{bt} A_b, c^{(2)}_{bt} A_b) + \beta\,\mathrm{KL}_{bt}

where the KL estimate compares with the reference policy's log-prob :math:`\rho` (k3 by
default: :math:`e^{\rho - \log\pi} - (\rho - \log\pi) - 1`). The loss is
:math:`L = \sum_{bt} w_{bt} \ell_{bt}` with the weights of
:func:`~grpo_kernels.objective.weights.token_weights`. Options beyond TRL's (tunix's dual clip,
log-ratio clamps, sampler weights, KL estimators and aggregations) are described where they act:
:func:`log_importance_ratio`, :func:`kl_divergence`, :func:`token_terms`,
:func:`~grpo_kernels.objective.weights.token_weights`. TRL's newer options (the CISPO, SAPO,
VESPO and LUSPO losses, the sampler correction, the off-policy sequence mask, the KL bias
correction, the entropy bonus and high-entropy token selection) act in :func:`policy_term` and
:func:`policy_factors`, with the factors of :mod:`grpo_kernels.objective.factors`;
docs/loss.md writes each out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective import factors as lw
from grpo_kernels.objective.base import (Array, BatchGather, BatchSum, _f32, _local,
                                         _row_counts, _sg, advantage_columns)
from grpo_kernels.objective.segments import Segments
from grpo_kernels.objective.weights import token_weights

if TYPE_CHECKING:
    from grpo_kernels.objective.batch import TokenBatch


def _clamped_diff(logp: Array, old_logp: Array, config: GRPOLossConfig) -> Array:
    """``logp - old_logp``, clamped to ``[-c, c]`` when ``config.log_ratio_clamp`` is ``c``."""
    diff = _f32(logp) - _f32(old_logp)
    if config.log_ratio_clamp is not None:
        diff = jnp.clip(diff, -config.log_ratio_clamp, config.log_ratio_clamp)
    return diff


def log_importance_ratio(logp: Array, old_logp: Array, mask: Array,
                         config: GRPOLossConfig, segments: Segments | None = None) -> Array:
    r"""Log importance ratio ``r``, ``[B, T]``.

    With :math:`d_{bt} = \log\pi - \log\pi_{old}`, clamped to
    :math:`[-c, c]` when ``config.log_ratio_clamp`` is ``c``:

    - ``token``: :math:`r_{bt} = d_{bt}`;
    - ``sequence``: :math:`r_{bt} = \bar d_b = \sum_s m_{bs} d_{bs} / \max(n_b, 1)`;
    - ``sequence_token``: :math:`r_{bt} = \log\pi_{bt} - \mathrm{sg}(\log\pi_{bt})
      + \mathrm{sg}(\bar d_b)`: the same value, the gradient of a token ratio.

    At both sequence levels ``config.sequence_log_ratio_max`` caps ``r`` from above (zero
    gradient past the cap). With packed rows (``segments``) a sequence is a segment:
    :math:`\bar d` is the mean over the token's segment
    (:meth:`~grpo_kernels.objective.segments.Segments.sequence_mean`).
    """
    logp = _f32(logp)
    diff = _clamped_diff(logp, old_logp, config)
    level = config.importance_sampling_level
    if level == "token":
        return diff
    mask = _f32(mask)
    if segments is None:
        seq = jnp.sum(diff * mask, axis=-1, keepdims=True) / jnp.maximum(_row_counts(mask), 1.0)
    else:
        seq = segments.sequence_mean(diff, mask)
    if level == "sequence":
        r = jnp.broadcast_to(seq, diff.shape)
    else:
        sg = jax.lax.stop_gradient
        r = logp - sg(logp) + sg(seq)
    if config.sequence_log_ratio_max is not None:
        r = jnp.minimum(r, config.sequence_log_ratio_max)
    return r


def kl_k3(logp: Array, ref_logp: Array) -> Array:
    r"""Schulman's k3 estimator :math:`e^{\rho - \log\pi} - (\rho - \log\pi) - 1 \geq 0`."""
    d = _f32(ref_logp) - _f32(logp)
    return jnp.exp(d) - d - 1.0


def kl_divergence(logp: Array, ref_logp: Array, config: GRPOLossConfig) -> Array:
    r"""Per-token KL estimate of ``config.kl_estimator`` with :math:`d = \rho - \log\pi`:
    ``k3`` :math:`e^d - d - 1`, ``k1`` :math:`-d`, ``k2`` :math:`d^2 / 2`; clamped to
    ``[-kl_clamp, kl_clamp]`` when ``config.kl_clamp`` is set."""
    if config.kl_estimator == "k3":
        kl = kl_k3(logp, ref_logp)
    else:
        d = _f32(ref_logp) - _f32(logp)
        kl = -d if config.kl_estimator == "k1" else 0.5 * d * d
    if config.kl_clamp is not None:
        kl = jnp.clip(kl, -config.kl_clamp, config.kl_clamp)
    return kl


def policy_factors(logp: Array, old: Array, mask: Array, advantages: Array,
                   config: GRPOLossConfig, sampler_logps: Array | None = None,
                   selected: Array | None = None) -> tuple[Array | None, Array | None]:
    r"""``(scale, phi)``: what TRL's newer options put on the policy term, without gradient.

    ``scale`` multiplies the per-token policy term: the product of the off-policy sequence mask
    (:func:`~grpo_kernels.objective.factors.off_policy_mask`), the high-entropy token mask
    (:func:`~grpo_kernels.objective.factors.entropy_mask`) and the sampler correction
    :math:`\rho` (:func:`~grpo_kernels.objective.factors.sampler_ratio`; VESPO folds it into
    ``phi`` instead), or ``None`` when none is on. ``phi``: VESPO's weight, else ``None``.
    ``old``: the old log-probs (``sg(logp)`` on-policy); ``advantages``: ``[B, 1]``;
    ``selected``: the high-entropy mask, required when ``top_entropy_quantile < 1`` (the
    caller computes it once: the entropy bonus uses it too).
    """
    factors, phi, rho = [], None, None
    if config.sampler_correction is not None:
        if sampler_logps is None:
            raise ValueError(f"sampler_correction={config.sampler_correction!r} needs "
                             "sampler_logps ([B, T] log-probs of the sampler), got None")
        rho = lw.sampler_ratio(old, sampler_logps, mask, config)
    if config.off_policy_mask_threshold is not None:
        behaviour = old if sampler_logps is None else sampler_logps
        factors.append(lw.off_policy_mask(logp, behaviour, mask, advantages,
                                          config.off_policy_mask_threshold))
    if config.top_entropy_quantile < 1.0:
        factors.append(selected)
    if config.loss_type == "vespo":
        diff = _clamped_diff(logp, old, config)
        phi = lw.vespo_weights(diff, mask, advantages, config, rho)
    elif rho is not None:
        factors.append(rho)
    scale = None
    for f in factors:
        scale = f if scale is None else scale * f
    return scale, phi


def _choose(pred: Array, yes: float, no: float) -> Array:
    """``where(pred, yes, no)`` of two Python floats as float32 constants. With the floats
    weakly typed, Pallas's Triton lowering (jax 0.10) gives them ``pred``'s bool type when
    ``pred`` is a scalar, and the one-pass GPU kernel, which runs this code per token, fails
    to lower."""
    return jnp.where(pred, jnp.float32(yes), jnp.float32(no))


def policy_term(logp: Array, log_ratio: Array, advantages: Array, config: GRPOLossConfig,
                phi: Array | None = None) -> tuple[Array, Array, Array]:
    r"""``(p, c_1, c_2)``: the per-token policy loss of ``config.loss_type`` (TRL's) and the
    ratios TRL's clip metrics use. With :math:`c = e^{r}`:

    - clipped (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``):
      :math:`c_1 = \min(c, \delta)`, :math:`c_2 = \mathrm{clip}(c, 1 - \epsilon_{low},
      1 + \epsilon_{high})`, :math:`p = -\min(c_1 A, c_2 A)`; with the dual clip ``c_d``
      (tunix's), :math:`p = \min(p, -c_d A)` where :math:`A < 0`;
    - ``cispo``: :math:`p = -\mathrm{sg}(\min(c, \epsilon_{high}))\,A \log\pi`;
    - ``sapo``: :math:`p = -\frac{4}{\tau_A}\sigma(\tau_A (c - 1))\,A` with
      :math:`\tau_A` = ``sapo_temperature_pos`` where :math:`A > 0`, else ``_neg``;
    - ``vespo``: :math:`p = -\phi\,A \log\pi` (``phi`` of
      :func:`~grpo_kernels.objective.factors.vespo_weights`).
    """
    a = _f32(advantages)
    coef_1 = jnp.exp(_f32(log_ratio))
    coef_2 = jnp.clip(coef_1, 1.0 - config.epsilon_low, 1.0 + config.epsilon_high)
    kind = config.loss_type
    if kind == "cispo":
        return -_sg(jnp.minimum(coef_1, config.epsilon_high)) * a * _f32(logp), coef_1, coef_2
    if kind == "sapo":
        tau = _choose(a > 0, config.sapo_temperature_pos, config.sapo_temperature_neg)
        return -(jax.nn.sigmoid(tau * (coef_1 - 1.0)) * 4.0 / tau) * a, coef_1, coef_2
    if kind == "vespo":
        return -phi * a * _f32(logp), coef_1, coef_2
    if config.delta is not None:
        coef_1 = jnp.minimum(coef_1, config.delta)
    policy = -jnp.minimum(coef_1 * a, coef_2 * a)
    if config.dual_clip is not None:
        policy = jnp.where(a < 0, jnp.minimum(policy, -config.dual_clip * a), policy)
    return policy, coef_1, coef_2


def token_terms(
    logp: Array,
    log_ratio: Array,
    advantages: Array,
    config: GRPOLossConfig,
    ref_logp: Array | None = None,
    sampler_weights: Array | None = None,
    scale: Array | None = None,
    phi: Array | None = None,
) -> dict[str, Array | None]:
    r"""The per-token pieces of the loss, every one of shape ``S`` (``logp``'s).

    The policy term :math:`p` of :func:`policy_term`, times ``scale`` (:func:`policy_factors`)
    and the sampler weights ``s`` (tunix's); the KL of :func:`kl_divergence`, times the
    unclipped ratio :math:`e^r` with ``kl_bias_correction``.

    Args:
      logp: Current policy log-probs of the chosen tokens.
      log_ratio: ``r`` of :func:`log_importance_ratio`.
      advantages: Broadcastable to ``S``.
      config: Loss options.
      ref_logp: Reference-policy log-probs; required when ``beta > 0``.
      sampler_weights: Optional per-token weights of the policy term (not of the KL term).
      scale, phi: Of :func:`policy_factors`.

    Returns:
      ``policy`` (``p``), ``kl`` (``None`` without ``ref_logp``), ``coef_1`` (``c_1``, TRL's
      clip metrics use it) and ``coef_2``.
    """
    policy, coef_1, coef_2 = policy_term(logp, log_ratio, advantages, config, phi)
    if scale is not None:
        policy = policy * scale
    if sampler_weights is not None:
        policy = policy * _f32(sampler_weights)
    kl = None if ref_logp is None else kl_divergence(logp, ref_logp, config)
    if kl is not None and config.kl_bias_correction:
        kl = kl * jnp.exp(_f32(log_ratio))
    return {"policy": policy, "kl": kl, "coef_1": coef_1, "coef_2": coef_2}


def weighted_loss(weights: Array, terms: dict[str, Array | None], config: GRPOLossConfig,
                  batch_sum: BatchSum = _local) -> tuple[Array, Array, Array]:
    """``(loss, policy_loss, kl_loss)``: the two parts summed with ``weights`` (of the whole
    batch, through ``batch_sum``) and ``loss = policy_loss + beta * kl_loss``, the KL only when
    ``beta > 0`` (``kl_loss`` is 0 without reference log-probs)."""
    policy_loss = batch_sum(jnp.sum(weights * terms["policy"]))
    kl = terms["kl"]
    kl_loss = jnp.float32(0.0) if kl is None else batch_sum(jnp.sum(weights * kl))
    loss = policy_loss + config.beta * kl_loss if config.beta > 0 else policy_loss
    return loss, policy_loss, kl_loss


def grpo_objective(
    logp: Array,
    batch: TokenBatch,
    config: GRPOLossConfig,
    entropy: Array | None = None,
    batch_sum: BatchSum = _local,
    batch_gather: BatchGather = _local,
) -> tuple[Array, dict[str, Array]]:
    r"""The scalar GRPO loss as a function of the chosen-token log-probs and entropies.

    :math:`L = \sum_{bt} w_{bt} \ell_{bt} - \text{entropy\_coef} \sum_{bt} u_{bt} H_{bt}`
    with :math:`\ell` of :func:`token_terms`, :math:`w` of
    :func:`~grpo_kernels.objective.weights.token_weights` and :math:`u` of
    :func:`~grpo_kernels.objective.factors.entropy_weights` (the bonus only when
    ``entropy_coef != 0``).

    Args:
      logp: ``[B, T]`` log-probs of the chosen tokens under the current policy.
      batch: The call's other inputs (:class:`~grpo_kernels.objective.batch.TokenBatch`; its
        ``ids`` are not read): the ``[B, T]`` mask; ``[B]`` advantages, or ``[B, T]`` (one
        per token: packed rows); the sampling policy's log-probs (``None``: on-policy, ``old =
        stop_gradient(logp)``, ratio exactly 1 with gradient ``A``); the reference policy's
        (required when ``beta > 0``); the ``dapo`` normaliser; the sampler weights of each
        token's policy term; the sampler's log-probs (``sampler_correction``); packed rows'
        segments (every sequence-level quantity per segment).
      config: Loss options.
      entropy: ``[B, T]`` entropies; needed by ``entropy_coef`` and ``top_entropy_quantile``.
      batch_sum: Local sum -> whole-batch sum (see :data:`BatchSum`).
      batch_gather: This device's rows -> the whole batch's (see :data:`BatchGather`).

    Returns:
      ``(loss, aux)``: ``aux`` holds the ``[B, T]`` ``coef_1`` and ``kl`` for the metrics and
      the two parts of the loss, ``policy_loss`` and ``kl_loss`` (the aggregated KL before
      ``beta``; zero without reference log-probs).
    """
    b = batch
    mask = b.mask
    logp = _f32(logp)
    adv = advantage_columns(b.advantages)
    old = _sg(logp) if b.old_logps is None else _f32(b.old_logps)
    log_ratio = log_importance_ratio(logp, old, mask, config, b.segments)
    selected = (lw.entropy_mask(entropy, mask, config, batch_gather)
                if config.top_entropy_quantile < 1.0 else None)
    scale, phi = policy_factors(logp, old, mask, adv, config, b.sampler_logps, selected)
    terms = token_terms(logp, log_ratio, adv, config, b.ref_logps, b.sampler_weights, scale,
                        phi)
    weights = token_weights(mask, config, b.num_items, batch_sum, b.segments)
    loss, policy_loss, kl_loss = weighted_loss(weights, terms, config, batch_sum)
    if config.has_entropy_bonus:
        u = lw.entropy_weights(mask, batch_sum, selected)
        loss = loss - config.entropy_coef * batch_sum(jnp.sum(u * _f32(entropy)))
    return loss, {"coef_1": terms["coef_1"], "kl": terms["kl"], "policy_loss": policy_loss,
                  "kl_loss": kl_loss}
