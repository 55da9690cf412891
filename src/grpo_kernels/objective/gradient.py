r"""The objective's derivatives w.r.t. the per-token statistics, as the fast implementations
need them: :math:`g = \partial L / \partial \log\pi` and :math:`h = \partial L / \partial H`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective import factors as lw
from grpo_kernels.objective.metrics import loss_metrics

if TYPE_CHECKING:
    from grpo_kernels.objective.batch import TokenBatch
from grpo_kernels.objective.base import BatchGather, BatchSum, _f32, _local
from grpo_kernels.objective.terms import (
    grpo_objective,
    log_importance_ratio,
    policy_factors,
    token_terms,
    weighted_loss,
)

Array = jax.Array


class RowGrad(NamedTuple):
    r"""What a fast implementation needs to form dlogits, per token (any one shape).

    .. math::

        \frac{\partial L}{\partial s_v} = g\,\mathbb{1}[v = y]
          - p_v\,\big(g + h\,(s_v - \mathrm{lse} + H)\big),
        \qquad s = z / \tau,\ p = \mathrm{softmax}(s)

    (the second part is :math:`h\,\partial H / \partial s_v`;
    :func:`grpo_kernels.ops.core.online_softmax.softmax_grad` writes it).

    Attributes:
      g: :math:`\partial L / \partial \log\pi(y)`, float32.
      h: :math:`\partial L / \partial H`, or ``None`` when the loss does not depend on the
        entropy (``entropy_coef == 0``): the term is then left out, not multiplied by zero.
      entropy: :math:`H` of each row (needed with ``h``), else ``None``.
    """

    g: Array
    h: Array | None = None
    entropy: Array | None = None

    def map(self, fn) -> "RowGrad":
        """``fn`` applied to every array (a reshape, a slice of rows)."""
        return RowGrad(*(None if x is None else fn(x) for x in self))

    def scaled(self, c: Array) -> "RowGrad":
        """``g`` and ``h`` times ``c`` (a loss cotangent); ``H`` unchanged."""
        return RowGrad(self.g * c, None if self.h is None else self.h * c, self.entropy)

    def over(self, temperature: float) -> "RowGrad":
        """``g`` and ``h`` over the softmax temperature (the factors of ``dL/dz = dL/ds /
        tau``); ``H`` unchanged."""
        return RowGrad(self.g / temperature,
                       None if self.h is None else self.h / temperature, self.entropy)


def loss_from_token_stats(
    logp: Array,
    entropy: Array,
    batch: TokenBatch,
    config: GRPOLossConfig,
    with_grad: bool = True,
    batch_sum: BatchSum = _local,
    batch_gather: BatchGather = _local,
) -> tuple[Array, dict[str, Array], RowGrad | None]:
    r"""``(loss, metrics, grad)`` from the ``[B, T]`` log-probs and entropies an
    implementation computed for ``batch`` (:func:`~grpo_kernels.objective.grpo_objective`).

    ``grad`` (``None`` without ``with_grad``) holds :math:`g = \partial L / \partial \log\pi`
    and, when ``entropy_coef != 0``, :math:`h = \partial L / \partial H` with ``entropy``:
    what the fast implementations turn into dlogits.
    """
    with_entropy = config.has_entropy_bonus

    def objective(lp, ent):
        return grpo_objective(lp, batch, config, ent, batch_sum, batch_gather)

    grad = None
    ent = _f32(entropy)
    if with_grad:
        argnums = (0, 1) if with_entropy else 0
        (loss, aux), d = jax.value_and_grad(objective, argnums, has_aux=True)(_f32(logp), ent)
        grad = RowGrad(d[0], d[1], ent) if with_entropy else RowGrad(d)
    else:
        loss, aux = objective(logp, ent)
    return loss, loss_metrics(logp, entropy, aux, batch, config, batch_sum), grad


def token_separable(config: GRPOLossConfig) -> bool:
    """Whether ``dL/dlogp`` (and ``dL/dH``) of a token depends on that token's inputs alone.

    True at token-level importance sampling when no option looks at other tokens: the weights
    of :func:`~grpo_kernels.objective.weights.token_weights` and of the entropy bonus depend
    only on the mask (and ``num_items_in_batch``), so ``L = sum_bt w_bt l(logp_bt)`` separates.
    Not at the sequence levels (a token's ratio depends on its whole sequence), nor with
    VESPO's sequence weight, the off-policy sequence mask, a sequence-level sampler correction
    or the batch-wide entropy quantile.
    """
    return (config.importance_sampling_level == "token"
            and config.loss_type != "vespo"
            and config.off_policy_mask_threshold is None
            and not (config.sampler_correction or "").startswith("sequence")
            and config.top_entropy_quantile == 1.0)


def separable_given_selection(config: GRPOLossConfig) -> bool:
    """Whether ``config`` has the batch-wide entropy quantile and is token-separable once the
    selection it makes (and so the entropy bonus's normaliser) is given: then
    :func:`selected_row_grad` is a token's gradient."""
    return (config.top_entropy_quantile < 1.0
            and token_separable(dataclasses.replace(config, top_entropy_quantile=1.0)))


def token_loss_grad(logp: Array, columns: dict[str, Array | None],
                    config: GRPOLossConfig) -> Array:
    r"""``g = \partial L / \partial \log\pi`` for any subset of tokens (see
    :func:`token_separable`).

    With :math:`L = \sum_{bt} w_{bt} \ell_{bt}` and :math:`\ell_{bt}` a function of
    :math:`\log\pi_{bt}` alone, :math:`g_{bt} = w_{bt}\,\partial\ell_{bt}/\partial\log\pi_{bt}`.
    ``columns`` are the tokens' inputs (``TokenBatch.token_columns``: ``weights``,
    ``advantages``, and where given ``old_logp``, ``ref_logp``, ``sampler_weights``, ``mask``
    and ``sampler_logps``), each of ``logp``'s shape (a chunk of flattened tokens, a kernel's
    block), and the result has that shape. ``mask`` and ``sampler_logps`` serve the
    token-level sampler correction. The entropy bonus's :math:`h` does not depend on ``logp``:
    :func:`entropy_bonus_grad`.
    """
    if not token_separable(config):
        raise ValueError("token_loss_grad needs a token-separable config (token level, no "
                         "VESPO, off-policy mask, sequence-level correction or entropy "
                         f"quantile), got {config!r}")
    c = columns
    advantages = c["advantages"]

    def total(lp):
        old = jax.lax.stop_gradient(lp) if c.get("old_logp") is None else _f32(c["old_logp"])
        ratio = log_importance_ratio(lp, old, None, config)
        m = jnp.ones_like(lp) if c.get("mask") is None else c["mask"]
        scale, _ = policy_factors(lp, old, m, advantages, config, c.get("sampler_logps"))
        terms = token_terms(lp, ratio, advantages, config, c.get("ref_logp"),
                            c.get("sampler_weights"), scale)
        return weighted_loss(_f32(c["weights"]), terms, config)[0]

    return jax.grad(total)(_f32(logp))


def token_row_grad(logp: Array, columns: dict[str, Array | None],
                   config: GRPOLossConfig) -> RowGrad:
    r"""The :class:`RowGrad` of tokens of a token-separable config from their own log-probs
    and their columns (``TokenBatch.token_columns``, any common shape, e.g. a chunk of rows or
    a kernel's ``[rows, 1]`` block): :math:`g` by :func:`token_loss_grad`, :math:`h` as given
    (without ``entropy``: a caller with the rows' :math:`H` adds it)."""
    return RowGrad(token_loss_grad(logp, columns, config), columns.get("h"))


def selected_row_grad(logp: Array, entropy: Array, selected: Array, norm: Array,
                      columns: dict[str, Array | None], config: GRPOLossConfig) -> RowGrad:
    r"""The :class:`RowGrad` of tokens of a config that :func:`separable_given_selection`
    accepts, with the high-entropy selection :math:`e` (``selected``, 0 or 1 per token, the
    mask already applied) and the entropy bonus's denominator ``norm``
    (:func:`~grpo_kernels.objective.factors.entropy_norm`) given rather than derived from the
    batch's quantile:

    .. math::

        g = w\,\partial\ell_e/\partial\log\pi, \qquad
        h = -\text{entropy\_coef}\cdot m\,e / \text{norm}

    with :math:`\ell_e` the per-token loss whose policy term is multiplied by :math:`e` (as
    the sampler weights multiply it). With the batch's own selection and denominator this is
    the gradient of :func:`~grpo_kernels.objective.grpo_objective`; any other pair gives the
    gradient the fused head's first pass forms before the quantile is known
    (:mod:`grpo_kernels.ops.lm_head_loss.xla_quantile`)."""
    c, free = columns, dataclasses.replace(config, top_entropy_quantile=1.0)
    sw = selected if c.get("sampler_weights") is None else c["sampler_weights"] * selected
    g = token_loss_grad(logp, {**c, "sampler_weights": sw}, free)
    if not config.has_entropy_bonus:
        return RowGrad(g)
    h = -config.entropy_coef * (_f32(c["mask"]) * selected / norm)
    return RowGrad(g, h, _f32(entropy))


def entropy_bonus_grad(mask: Array, config: GRPOLossConfig,
                       batch_sum: BatchSum = _local) -> Array | None:
    r""":math:`h = \partial L / \partial H = -\text{entropy\_coef}\cdot u` of a
    token-separable config (:func:`~grpo_kernels.objective.factors.entropy_weights`, no
    entropy quantile), or ``None`` when ``entropy_coef == 0``."""
    if not config.has_entropy_bonus:
        return None
    return -config.entropy_coef * lw.entropy_weights(mask, batch_sum)
