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
    \ell_{bt} &= -\min(c^{(1)}_{bt} A_b, c^{(2)}_{bt} A_b) + \beta\,\mathrm{KL}_{bt}

where the KL estimate compares with the reference policy's log-prob :math:`\rho` (k3 by
default: :math:`e^{\rho - \log\pi} - (\rho - \log\pi) - 1`). The loss is
:math:`L = \sum_{bt} w_{bt} \ell_{bt}` with the weights of :func:`token_weights`. Options beyond
TRL's (tunix's dual clip, log-ratio clamps, sampler weights, KL estimators and aggregations) are
described where they act: :func:`log_importance_ratio`, :func:`kl_divergence`,
:func:`token_terms`, :func:`token_weights`.
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


def _row_counts(mask: Array) -> Array:
    """``[B, 1]`` tokens per sequence, :math:`n_b`."""
    return jnp.sum(mask, axis=-1, keepdims=True)


def token_weights(
    mask: Array,
    config: GRPOLossConfig,
    num_items_in_batch: Array | float | None = None,
    batch_sum: BatchSum = _local,
) -> Array:
    r"""Per-token weights ``w`` such that the loss is ``sum(w * per_token_loss)``.

    With :math:`n_b = \sum_t m_{bt}`, :math:`N = \sum_b n_b`, ``T`` the mask's length and
    :math:`R = \max(|\{b : n_b > 0\}|, 1)` the non-empty sequences, by ``loss_type`` (TRL):

    - ``grpo``:    :math:`w_{bt} = m_{bt} / (B \max(n_b, 1))`
    - ``bnpo``:    :math:`w_{bt} = m_{bt} / \max(N, 1)`
    - ``dr_grpo``: :math:`w_{bt} = m_{bt} / (B \cdot \text{max\_completion\_length})`
    - ``dapo``:    :math:`w_{bt} = m_{bt} / \text{num\_items\_in\_batch}`
      (default :math:`\max(N, 1)`)

    or, when ``config.loss_agg_mode`` is set, by tunix's aggregation (replacing the above):

    - ``token-mean``: :math:`m_{bt} / \max(N, 1)`
    - ``sequence-mean-token-mean``: :math:`m_{bt} / (R \max(n_b, 1))`
    - ``sequence-mean-token-scale``: :math:`m_{bt} / (R\,T)`
    - ``seq-mean-token-sum`` and ``sequence-mean-token-sum-norm``: :math:`m_{bt} / R`

    Args:
      mask: ``[B, T]`` completion mask in {0, 1}.
      config: Loss options; ``loss_type``, ``loss_agg_mode`` and ``max_completion_length``
        are read.
      num_items_in_batch: The ``dapo`` normaliser (of the whole batch); ignored otherwise.
      batch_sum: Local sum -> whole-batch sum (see :data:`BatchSum`); ``B``, ``N`` and ``R``
        above are whole-batch figures.

    Returns:
      ``[B, T]`` float32 weights (this device's rows); all zero when the mask is all zero.
    """
    mask = _f32(mask)
    if config.loss_agg_mode is not None:
        return _tunix_weights(mask, config.loss_agg_mode, batch_sum)
    if config.loss_type == "grpo":
        return mask / (jnp.maximum(_row_counts(mask), 1.0) * batch_sum(_f32(mask.shape[0])))
    if config.loss_type == "dr_grpo":
        return mask / (batch_sum(_f32(mask.shape[0])) * float(config.max_completion_length))
    if config.loss_type == "bnpo" or num_items_in_batch is None:
        return _token_mean_weights(mask, batch_sum)
    return mask / _f32(num_items_in_batch)


def _token_mean_weights(mask: Array, batch_sum: BatchSum) -> Array:
    r""":math:`m_{bt} / \max(N, 1)` (``bnpo``, tunix's ``token-mean``)."""
    return mask / jnp.maximum(batch_sum(jnp.sum(mask)), 1.0)


def _tunix_weights(mask: Array, mode: str, batch_sum: BatchSum) -> Array:
    """The weights of tunix's ``loss_agg_mode`` (see :func:`token_weights`)."""
    if mode == "token-mean":
        return _token_mean_weights(mask, batch_sum)
    counts = _row_counts(mask)
    rows = jnp.maximum(batch_sum(jnp.sum((counts > 0).astype(jnp.float32))), 1.0)
    if mode == "sequence-mean-token-mean":
        return mask / (jnp.maximum(counts, 1.0) * rows)
    if mode == "sequence-mean-token-scale":
        return mask / (rows * float(mask.shape[-1]))
    return mask / rows  # seq-mean-token-sum, sequence-mean-token-sum-norm


def log_importance_ratio(logp: Array, old_logp: Array, mask: Array,
                         config: GRPOLossConfig) -> Array:
    r"""Log importance ratio ``r``, ``[B, T]``.

    With :math:`d_{bt} = \log\pi - \log\pi_{old}`, clamped to
    :math:`[-c, c]` when ``config.log_ratio_clamp`` is ``c``:

    - ``token``: :math:`r_{bt} = d_{bt}`;
    - ``sequence``: :math:`r_{bt} = \bar d_b = \sum_s m_{bs} d_{bs} / \max(n_b, 1)`;
    - ``sequence_token``: :math:`r_{bt} = \log\pi_{bt} - \mathrm{sg}(\log\pi_{bt})
      + \mathrm{sg}(\bar d_b)`: the same value, the gradient of a token ratio.

    At both sequence levels ``config.sequence_log_ratio_max`` caps ``r`` from above (zero
    gradient past the cap).
    """
    logp = _f32(logp)
    diff = logp - _f32(old_logp)
    if config.log_ratio_clamp is not None:
        diff = jnp.clip(diff, -config.log_ratio_clamp, config.log_ratio_clamp)
    level = config.importance_sampling_level
    if level == "token":
        return diff
    mask = _f32(mask)
    seq = jnp.sum(diff * mask, axis=-1, keepdims=True) / jnp.maximum(_row_counts(mask), 1.0)
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


def token_terms(
    logp: Array,
    log_ratio: Array,
    advantages: Array,
    config: GRPOLossConfig,
    ref_logp: Array | None = None,
    sampler_weights: Array | None = None,
) -> dict[str, Array | None]:
    r"""The per-token pieces of the loss, every one of shape ``S`` (``logp``'s).

    .. math::

        c_1 = \min(e^{r}, \delta), \quad c_2 = \mathrm{clip}(e^{r}, 1 - \epsilon_{low},
        1 + \epsilon_{high}), \quad p = -\min(c_1 A, c_2 A)

    then, with the dual clip ``c`` (``config.dual_clip``), :math:`p = \min(p, -cA)` where
    :math:`A < 0`; and :math:`p \leftarrow s\,p` with the sampler weights ``s``.

    Args:
      logp: Current policy log-probs of the chosen tokens.
      log_ratio: ``r`` of :func:`log_importance_ratio`.
      advantages: Broadcastable to ``S``.
      config: Loss options.
      ref_logp: Reference-policy log-probs; required when ``beta > 0``.
      sampler_weights: Optional per-token weights of the policy term (not of the KL term).

    Returns:
      ``policy`` (``p``), ``kl`` (:func:`kl_divergence`, ``None`` without ``ref_logp``),
      ``coef_1`` (``c_1``, TRL's clip metrics use it) and ``coef_2``.
    """
    advantages = _f32(advantages)
    coef_1 = jnp.exp(_f32(log_ratio))
    coef_2 = jnp.clip(coef_1, 1.0 - config.epsilon_low, 1.0 + config.epsilon_high)
    if config.delta is not None:
        coef_1 = jnp.minimum(coef_1, config.delta)
    policy = -jnp.minimum(coef_1 * advantages, coef_2 * advantages)
    if config.dual_clip is not None:
        policy = jnp.where(advantages < 0,
                           jnp.minimum(policy, -config.dual_clip * advantages), policy)
    if sampler_weights is not None:
        policy = policy * _f32(sampler_weights)
    kl = None if ref_logp is None else kl_divergence(logp, ref_logp, config)
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
    mask: Array,
    advantages: Array,
    config: GRPOLossConfig,
    old_logps: Array | None = None,
    ref_logps: Array | None = None,
    num_items_in_batch: Array | float | None = None,
    batch_sum: BatchSum = _local,
    sampler_weights: Array | None = None,
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
      sampler_weights: Optional ``[B, T]`` weights of each token's policy term.

    Returns:
      ``(loss, aux)``: ``aux`` holds the ``[B, T]`` ``coef_1`` and ``kl`` for the metrics and
      the two parts of the loss, ``policy_loss`` and ``kl_loss`` (the aggregated KL before
      ``beta``; zero without ``ref_logps``).
    """
    logp = _f32(logp)
    old = jax.lax.stop_gradient(logp) if old_logps is None else _f32(old_logps)
    log_ratio = log_importance_ratio(logp, old, mask, config)
    terms = token_terms(logp, log_ratio, _f32(advantages)[:, None], config, ref_logps,
                        sampler_weights)
    weights = token_weights(mask, config, num_items_in_batch, batch_sum)
    loss, policy_loss, kl_loss = weighted_loss(weights, terms, config, batch_sum)
    return loss, {"coef_1": terms["coef_1"], "kl": terms["kl"], "policy_loss": policy_loss,
                  "kl_loss": kl_loss}


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

    - ``logp`` and ``token_entropy``: ``[B, T]`` per-token log-probs of the chosen tokens and
      entropies of ``softmax(z / temperature)``.
    - ``clip_ratio_low``: share with ``coef_1 < 1 - eps_low`` and ``A < 0``;
      ``clip_ratio_high``: ``coef_1 > 1 + eps_high`` and ``A > 0``; ``clip_ratio_region``:
      either. Token level: masked token mean; sequence levels: mean over sequences.
    - ``kl``: masked token mean of the per-token KL (0 when no ``ref_logps`` were given).
    - ``entropy``: masked token mean of ``token_entropy``.
    - ``policy_loss`` and ``kl_loss``: the two parts of the loss
      (``loss = policy_loss + beta * kl_loss``).
    """
    sg = jax.lax.stop_gradient
    coef_1 = sg(aux["coef_1"])
    adv = _f32(advantages)[:, None]
    low = ((coef_1 < 1.0 - config.epsilon_low) & (adv < 0)).astype(jnp.float32)
    high = ((coef_1 > 1.0 + config.epsilon_high) & (adv > 0)).astype(jnp.float32)
    region = jnp.maximum(low, high)
    if config.importance_sampling_level != "token":
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
    sampler_weights: Array | None = None,
    batch_sum: BatchSum = _local,
) -> tuple[Array, dict[str, Array], Array | None]:
    r"""``(loss, metrics, g)`` from the ``[B, T]`` log-probs and entropies of an implementation.

    ``g = \partial L / \partial \log\pi`` (``[B, T]`` float32, ``None`` without ``with_grad``)
    is what the fast implementations turn into dlogits.
    """

    def objective(lp):
        return grpo_objective(lp, mask, advantages, config, old_logp, ref_logp,
                              num_items_in_batch, batch_sum, sampler_weights)

    g = None
    if with_grad:
        (loss, aux), g = jax.value_and_grad(objective, has_aux=True)(logp)
    else:
        loss, aux = objective(logp)
    return loss, loss_metrics(logp, entropy, aux, mask, advantages, config, batch_sum), g


def token_separable(config: GRPOLossConfig) -> bool:
    """Whether ``dL/dlogp`` of a token depends on that token's inputs alone.

    True at token-level importance sampling: the weights of :func:`token_weights` depend only on
    the mask (and ``num_items_in_batch``), so ``L = sum_bt w_bt l(logp_bt)`` separates. At
    the sequence levels the ratio of a token depends on the log-probs of its whole sequence.
    """
    return config.importance_sampling_level == "token"


def token_loss_grad(
    logp: Array,
    weights: Array,
    advantages: Array,
    config: GRPOLossConfig,
    old_logp: Array | None = None,
    ref_logp: Array | None = None,
    sampler_weights: Array | None = None,
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
        ratio = log_importance_ratio(lp, old, None, config)
        terms = token_terms(lp, ratio, advantages, config, ref_logp, sampler_weights)
        return weighted_loss(_f32(weights), terms, config)[0]

    return jax.grad(total)(_f32(logp))
