r"""Online-softmax row statistics shared by the XLA implementation and the Pallas kernels.

Per row, with ``s = z / tau`` and a shift ``m`` (normally the row max):

.. math::

    S = \sum_v e^{s_v - m},\quad Q = \sum_v e^{s_v - m}(s_v - m),\quad
    \mathrm{lse} = m + \log S,\quad H = \log S - Q / S,\quad \log\pi(y) = s_y - \mathrm{lse}.

A row swept in blocks keeps a running ``(m, S, Q)`` triple and folds each block's triple in with
:func:`merge_stats`. The functions are pure ``jnp`` on any leading shape, so the same code runs in
XLA and inside Pallas TPU and GPU kernels.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from grpo_kernels.compat import vary_like

Array = jax.Array
Stats = tuple[Array, Array, Array]
# Scaled logits below this have p = 0 in float32. The entropy term's gradient floors u here, so
# that a -inf logit (a masked vocabulary entry) gets c_h * 0 * (floor + H) = 0, not 0 * -inf;
# at -1e30 the product with any c_h up to 1e8 stays finite.
GRAD_FLOOR = -1e30


def soft_cap(z: Array, cap: float | None) -> Array:
    r"""Soft-capped logits :math:`c \tanh(z / c)` (Gemma 2's ``final_logit_softcap``), applied
    to float32 ``z`` after the head and before the temperature; ``cap=None``: ``z``."""
    return z if cap is None else cap * jnp.tanh(z / cap)


def soft_cap_grad(capped: Array, cap: float | None) -> Array | float:
    r""":math:`\partial\,c \tanh(z / c) / \partial z = 1 - \tanh^2(z / c)`, from the capped
    value ``capped`` :math:`= c \tanh(z / c)`; 1 without a cap."""
    return 1.0 if cap is None else 1.0 - jnp.square(capped / cap)


def cap_logits(x: Array, cap: float | None, mask: Array | None = None) -> Array:
    """``x`` in float32, soft-capped by ``cap`` (:func:`soft_cap`); where ``mask`` is false,
    ``-inf`` (a kernel's masked loads read ``-inf``, which the cap would map to ``-cap``)."""
    x = soft_cap(x.astype(jnp.float32), cap)
    return x if cap is None or mask is None else jnp.where(mask, x, -jnp.inf)


def with_cap_grad(d: Array, capped: Array, cap: float | None) -> Array:
    """A gradient ``d`` w.r.t. the capped logits ``capped`` made one w.r.t. the uncapped
    logits (times :func:`soft_cap_grad`); ``d`` itself, untouched, without a cap."""
    return d if cap is None else d * soft_cap_grad(capped, cap)


def sweep(n: int, block: int, body: Callable[[Any, int, Any], Any], carry: Any, *,
          start: Callable[[Any], Any] | None = None, like: tuple[Any, ...] = ()) -> Any:
    """Runs ``body(start, size, carry)`` over ``[0, n)`` in blocks that never overlap.

    Full blocks go through a ``fori_loop`` (traced start ``start(i)``, default ``i * block``;
    a Pallas TPU kernel passes an alignment hint); the remainder, if any, is one more call with
    a static start, so no element is visited twice and nothing is padded. Inside ``shard_map``
    the carry is first typed as varying over the mesh axes of the arrays ``like`` (the data
    the body reads).
    """
    start = start or (lambda i: i * block)
    carry = vary_like(carry, *like)
    full, tail = divmod(n, block)
    if full == 1:
        carry = body(0, block, carry)
    elif full > 1:
        carry = jax.lax.fori_loop(0, full, lambda i, c: body(start(i), block, c), carry)
    if tail:
        carry = body(full * block, tail, carry)
    return carry


def block_stats(s: Array, m: Array | None = None, keepdims: bool = False) -> Stats:
    """``(m, S, Q)`` over the last axis of a float32 block ``s``.

    ``m`` defaults to the row max. Any other finite shift gives the same ``lse`` and entropy
    (both are shift-invariant) as long as nothing overflows. With ``keepdims`` the results keep
    a size-1 last axis (and a given ``m`` must have it too).
    """
    if m is None:
        m = jnp.max(s, axis=-1, keepdims=True)
    elif not keepdims:
        m = m[..., None]
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    shifted = s - m_safe
    e = jnp.exp(shifted)
    total = jnp.sum(e, axis=-1, keepdims=True)
    q = jnp.sum(jnp.where(e > 0, e * shifted, 0.0), axis=-1, keepdims=True)
    if keepdims:
        return m, total, q
    return m[..., 0], total[..., 0], q[..., 0]


def _rebase(m: Array, total: Array, q: Array, c_safe: Array) -> tuple[Array, Array]:
    """``(S, Q)`` of a part with shift ``m`` moved to the shift ``c_safe``:

    ``sum e^{s-c} = e^{m-c} S``,  ``sum e^{s-c}(s-c) = e^{m-c} (Q + S (m-c))``; an empty part
    (``S = 0``, ``m = -inf``) stays empty.
    """
    scale = jnp.where(total > 0, jnp.exp(m - c_safe), 0.0)
    return scale * total, scale * (q + jnp.where(total > 0, total * (m - c_safe), 0.0))


def merge_stats(a: Stats, b: Stats) -> Stats:
    """Online-softmax merge of two ``(m, S, Q)`` triples over disjoint parts of a row."""
    (ma, sa, qa), (mb, sb, qb) = a, b
    m = jnp.maximum(ma, mb)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    (sa, qa), (sb, qb) = _rebase(ma, sa, qa, m_safe), _rebase(mb, sb, qb, m_safe)
    return m, sa + sb, qa + qb


def reduce_stats(m: Array, total: Array, q: Array, axis: int = -1) -> Stats:
    """:func:`merge_stats` folded over ``axis``: the triples of disjoint parts of a row (e.g.
    one per vocabulary tile, laid out along ``axis``) merged into the row's triple."""
    c = jnp.max(m, axis=axis, keepdims=True)
    total, q = _rebase(m, total, q, jnp.where(jnp.isfinite(c), c, 0.0))
    return jnp.squeeze(c, axis), jnp.sum(total, axis=axis), jnp.sum(q, axis=axis)


def finish(m: Array, total: Array, q: Array, chosen: Array) -> Stats:
    """``(logp, lse, entropy)`` from a row's ``(m, S, Q)`` and its chosen (scaled) logit."""
    log_total = jnp.log(total)
    lse = m + log_total
    return chosen - lse, lse, log_total - q / total


def softmax_grad(u: Array, hit: Array, coef: Array, hcoef: Array | None = None,
                 entropy: Array | None = None, p: Array | None = None) -> Array:
    r"""The loss's derivative w.r.t. a block of scaled logits, float32, from ``u = s - lse``:

    .. math::

        c\,(\mathbb{1}[v = y] - p_v) - c_h\,p_v\,(u_v + H), \qquad p_v = e^{u_v}

    where ``coef`` :math:`c` and ``hcoef`` :math:`c_h` are the per-row
    :math:`\partial L / \partial \log\pi(y)` and :math:`\partial L / \partial H` (times any
    factor, e.g. :math:`1/\tau` and the loss cotangent), ``hit`` marks the chosen column and
    ``entropy`` is the row's :math:`H` (the second term is :math:`c_h\,\partial H/\partial
    s_v`, since :math:`H = -\sum_v p_v u_v`). Per-row arrays broadcast against ``u``; without
    ``hcoef`` the second term is left out. ``p``, when given, is :math:`e^{u}` already
    computed: a kernel whose speed depends on where the exponential sits among its loads (the
    Triton GPU kernel) computes it first. Pure ``jnp``: the same code in XLA and in kernels.
    """
    if p is None:
        p = jnp.exp(u)
    d = coef * jnp.where(hit, 1.0 - p, -p)
    if hcoef is not None:
        d = d - hcoef * (p * (jnp.maximum(u, GRAD_FLOOR) + entropy))
    return d
