r"""The GRPO objective on per-token log-probabilities ``[B, T]``.

Every implementation of the loss (reference, chunked XLA, Pallas, fused LM head) reduces the
vocabulary to per-token statistics and then calls the functions here, so the math lives in one
place. All inputs are upcast to float32.

Notation, for sequence ``b`` and position ``t`` with mask :math:`m_{bt} \in \{0, 1\}`:

.. math::

    r_{bt} &= \log\pi(y_{bt}) - \log\pi_{old}(y_{bt})                    && \text{(token level)} \\
    r_{bt} &= \frac{\sum_s m_{bs} (\log\pi(y_{bs}) - \log\pi_{old}(y_{bs}))}
                   {\max(\sum_s m_{bs}, 1)}                               && \text{(sequence level, GSPO)} \\
    c^{(1)}_{bt} &= \min(e^{r_{bt}}, \delta), \quad
    c^{(2)}_{bt} = \mathrm{clip}(e^{r_{bt}}, 1 - \epsilon_{low}, 1 + \epsilon_{high}) \\
    \ell_{bt} &= -\min(c^{(1)}_{bt} A_b, c^{(2)}_{bt} A_b)
                + \beta\,(e^{\rho_{bt} - \log\pi} - (\rho_{bt} - \log\pi) - 1)

where :math:`\rho` is the reference policy's log-prob. The loss is
:math:`L = \sum_{bt} w_{bt} \ell_{bt}` with the weights of :func:`token_weights`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from grpo_kernels.config import GRPOLossConfig

Array = jax.Array

BatchSum = Callable[[Array], Array]
"""Maps a sum over this device's part of the batch to the sum over the whole batch.

The identity on one device; ``psum`` over the batch axes inside ``shard_map``
(:mod:`grpo_kernels.sharding`). Every normaliser and every mean below goes through it, so a
sharded loss equals the one-device loss.
"""


def _local(x: Array) -> Array:
    return x


def _f32(x: Any) -> Array:
    return jnp.asarray(x, jnp.float32)


def token_weights(
    mask: Array,
    config: GRPOLossConfig,
    num_items_in_batch: Array | float | None = None,
    batch_sum: BatchSum = _local,
) -> Array:
    r"""Per-token weights ``w`` such that the loss is ``sum(w * per_token_loss)``.

    With :math:`n_b = \sum_t m_{bt}` and :math:`N = \sum_b n_b`:

    - ``grpo``:    :math:`w_{bt} = m_{bt} / (B \max(n_b, 1))`
    - ``bnpo``:    :math:`w_{bt} = m_{bt} / \max(N, 1)`
    - ``dr_grpo``: :math:`w_{bt} = m_{bt} / (B \cdot \text{max\_completion\_length})`
    - ``dapo``:    :math:`w_{bt} = m_{bt} / \text{num\_items\_in\_batch}`
      (default :math:`\max(N, 1)`)

    Args:
      mask: ``[B, T]`` completion mask in {0, 1}.
      config: Loss options; ``loss_type`` and ``max_completion_length`` are read.
      num_items_in_batch: The ``dapo`` normaliser (of the whole batch); ignored by the other
        loss types.
      batch_sum: Local sum -> whole-batch sum (see :data:`BatchSum`); ``B`` and ``N`` above
        are whole-batch figures.

    Returns:
      ``[B, T]`` float32 weights (this device's rows); all zero when the mask is all zero.
    """
    mask = _f32(mask)
    if config.loss_type == "grpo":
        counts = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0)
        return mask / (counts * batch_sum(_f32(mask.shape[0])))
    if config.loss_type == "dr_grpo":
        return mask / (batch_sum(_f32(mask.shape[0])) * float(config.max_completion_length))
    if config.loss_type == "bnpo" or num_items_in_batch is None:
        return mask / jnp.maximum(batch_sum(jnp.sum(mask)), 1.0)
    return mask / _f32(num_items_in_batch)


def log_importance_ratio(
    logp: Array, old_logp: Array, mask: Array, level: str
) -> Array:
    """Log importance ratio ``r`` (see module docstring), broadcast to ``[B, T]``."""
    diff = _f32(logp) - _f32(old_logp)
    if level == "token":
        return diff
    mask = _f32(mask)
    seq = jnp.sum(diff * mask, axis=-1, keepdims=True) / jnp.maximum(
        jnp.sum(mask, axis=-1, keepdims=True), 1.0
    )
    return jnp.broadcast_to(seq, diff.shape)


def kl_k3(logp: Array, ref_logp: Array) -> Array:
    r"""Schulman's k3 estimator :math:`e^{\rho - \log\pi} - (\rho - \log\pi) - 1 \geq 0`."""
    d = _f32(ref_logp) - _f32(logp)
    return jnp.exp(d) - d - 1.0


def per_token_loss(
    logp: Array,
    log_ratio: Array,
    advantages: Array,
    config: GRPOLossConfig,
    ref_logp: Array | None = None,
) -> tuple[Array, Array, Array | None]:
    """Per-token clipped surrogate (plus the KL penalty when ``beta > 0``).

    Args:
      logp: Current policy log-probs of the chosen tokens, any shape ``S``.
      log_ratio: Log importance ratio, shape ``S`` (from :func:`log_importance_ratio`).
      advantages: Advantages broadcastable to ``S``.
      config: Loss options.
      ref_logp: Reference-policy log-probs, shape ``S``; required when ``beta > 0``.

    Returns:
      ``(loss, coef_1, kl)``: the per-token loss, the (delta-capped) ratio used by TRL's clip
      metrics, and the k3 KL (``None`` without ``ref_logp``).
    """
    advantages = _f32(advantages)
    coef_1 = jnp.exp(_f32(log_ratio))
    coef_2 = jnp.clip(coef_1, 1.0 - config.epsilon_low, 1.0 + config.epsilon_high)
    if config.delta is not None:
        coef_1 = jnp.minimum(coef_1, config.delta)
    loss = -jnp.minimum(coef_1 * advantages, coef_2 * advantages)
    kl = None if ref_logp is None else kl_k3(logp, ref_logp)
    if config.beta > 0:
        loss = loss + config.beta * kl
    return loss, coef_1, kl


def grpo_objective(
    logp: Array,
    mask: Array,
    advantages: Array,
    config: GRPOLossConfig,
    old_logps: Array | None = None,
    ref_logps: Array | None = None,
    num_items_in_batch: Array | float | None = None,
    batch_sum: BatchSum = _local,
) -> tuple[Array, dict[str, Array]]:
    """The scalar GRPO loss as a function of the chosen-token log-probs.

    Args:
      logp: ``[B, T]`` log-probs of the chosen tokens under the current policy.
      mask: ``[B, T]`` completion mask.
      advantages: ``[B]`` advantages.
      config: Loss options.
      old_logps: ``[B, T]`` log-probs under the sampling policy; ``None`` means on-policy
        (``old = stop_gradient(logp)``, ratio exactly 1 with gradient ``A``).
      ref_logps: ``[B, T]`` reference-policy log-probs; required when ``beta > 0``.
      num_items_in_batch: The ``dapo`` normaliser.
      batch_sum: Local sum -> whole-batch sum (see :data:`BatchSum`).

    Returns:
      ``(loss, aux)`` where ``aux`` holds ``coef_1`` and ``kl`` (``[B, T]``) for the metrics.
    """
    logp = _f32(logp)
    old = jax.lax.stop_gradient(logp) if old_logps is None else _f32(old_logps)
    log_ratio = log_importance_ratio(logp, old, mask, config.importance_sampling_level)
    per_token, coef_1, kl = per_token_loss(
        logp, log_ratio, _f32(advantages)[:, None], config, ref_logps
    )
    weights = token_weights(mask, config, num_items_in_batch, batch_sum)
    loss = batch_sum(jnp.sum(weights * per_token))
    return loss, {"coef_1": coef_1, "kl": kl}


def masked_mean(x: Array, mask: Array, batch_sum: BatchSum = _local) -> Array:
    """``sum(x * mask) / max(sum(mask), 1)``: zero, never NaN, for an all-zero mask."""
    mask = _f32(mask)
    return batch_sum(jnp.sum(_f32(x) * mask)) / jnp.maximum(batch_sum(jnp.sum(mask)), 1.0)


def loss_metrics(
    logp: Array,
    entropy: Array,
    aux: dict[str, Array],
    mask: Array,
    advantages: Array,
    config: GRPOLossConfig,
    batch_sum: BatchSum = _local,
) -> dict[str, Array]:
    """Metrics reported beside the loss (TRL's definitions), all without gradient.

    Means are over the whole batch (``batch_sum``, see :data:`BatchSum`):

    - ``logp``: ``[B, T]`` per-token log-probs of the chosen tokens.
    - ``clip_ratio_low``: share with ``coef_1 < 1 - eps_low`` and ``A < 0``;
      ``clip_ratio_high``: ``coef_1 > 1 + eps_high`` and ``A > 0``; ``clip_ratio_region``:
      either. Token level: masked token mean; sequence level: mean over sequences.
    - ``kl``: masked token mean of the k3 KL (0 when no ``ref_logps`` were given).
    - ``entropy``: masked token mean of the entropy of ``softmax(z / temperature)``.
    """
    sg = jax.lax.stop_gradient
    coef_1 = sg(aux["coef_1"])
    adv = _f32(advantages)[:, None]
    low = ((coef_1 < 1.0 - config.epsilon_low) & (adv < 0)).astype(jnp.float32)
    high = ((coef_1 > 1.0 + config.epsilon_high) & (adv > 0)).astype(jnp.float32)
    region = jnp.maximum(low, high)
    if config.importance_sampling_level == "sequence":
        def clip_mean(x):
            return batch_sum(jnp.sum(x[:, 0])) / jnp.maximum(batch_sum(_f32(x.shape[0])), 1.0)
    else:
        def clip_mean(x):
            return masked_mean(x, mask, batch_sum)
    kl = aux["kl"]
    return {
        "logp": sg(_f32(logp)),
        "clip_ratio_low": clip_mean(low),
        "clip_ratio_high": clip_mean(high),
        "clip_ratio_region": clip_mean(region),
        "kl": jnp.float32(0.0) if kl is None else masked_mean(sg(kl), mask, batch_sum),
        "entropy": masked_mean(sg(entropy), mask, batch_sum),
    }


def loss_from_token_stats(
    logp: Array,
    entropy: Array,
    mask: Array,
    advantages: Array,
    config: GRPOLossConfig,
    old_logp: Array | None = None,
    ref_logp: Array | None = None,
    num_items_in_batch: Array | None = None,
    with_grad: bool = True,
) -> tuple[Array, dict[str, Array], Array | None]:
    r"""``(loss, metrics, g)`` from the ``[B, T]`` log-probs and entropies of an implementation.

    ``g = \partial L / \partial \log\pi`` (``[B, T]`` float32, ``None`` without ``with_grad``)
    is what the fast implementations turn into dlogits.
    """

    def objective(lp):
        return grpo_objective(lp, mask, advantages, config, old_logp, ref_logp,
                              num_items_in_batch)

    g = None
    if with_grad:
        (loss, aux), g = jax.value_and_grad(objective, has_aux=True)(logp)
    else:
        loss, aux = objective(logp)
    return loss, loss_metrics(logp, entropy, aux, mask, advantages, config), g


def token_separable(config: GRPOLossConfig) -> bool:
    """Whether ``dL/dlogp`` of a token depends on that token's inputs alone.

    True at token-level importance sampling: the weights of :func:`token_weights` depend only on
    the mask (and ``num_items_in_batch``), so ``L = sum_bt w_bt l(logp_bt)`` separates. At
    sequence level (GSPO) the ratio of a token depends on the log-probs of its whole sequence.
    """
    return config.importance_sampling_level == "token"


def token_loss_grad(
    logp: Array,
    weights: Array,
    advantages: Array,
    config: GRPOLossConfig,
    old_logp: Array | None = None,
    ref_logp: Array | None = None,
) -> Array:
    r"""``g = \partial L / \partial \log\pi`` for any subset of tokens, token level only.

    With :math:`L = \sum_{bt} w_{bt} \ell_{bt}` and :math:`\ell_{bt}` a function of
    :math:`\log\pi_{bt}` alone (see :func:`token_separable`),
    :math:`g_{bt} = w_{bt}\,\partial\ell_{bt}/\partial\log\pi_{bt}`: every argument is a
    per-token array of one shape (a chunk of flattened tokens), and the result has that shape.
    """
    if not token_separable(config):
        raise ValueError("token_loss_grad needs importance_sampling_level='token', got "
                         f"{config.importance_sampling_level!r}")

    def total(lp):
        old = jax.lax.stop_gradient(lp) if old_logp is None else _f32(old_logp)
        per_token, _, _ = per_token_loss(lp, lp - old, advantages, config, ref_logp)
        return jnp.sum(_f32(weights) * per_token)

    return jax.grad(total)(_f32(logp))
