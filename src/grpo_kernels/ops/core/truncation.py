r"""The sampler's truncation of a row's distribution: top-k, top-p and min-p, as one floor.

A sampler that draws under ``min_p``, ``top_k`` or ``top_p`` draws from a renormalised part of
the row; its log-probs are those of that part, not of the whole vocabulary. With the scaled
logits :math:`s = z / \tau` of one row and its max :math:`m`, vLLM's v1 sampler (its PyTorch
path and its ``processed_logprobs``) applies, in order:

1. min-p: keep :math:`v` iff :math:`p_v \ge \text{min\_p} \cdot p_{\max}`, that is
   :math:`s_v \ge m + \log \text{min\_p}`;
2. top-k: keep :math:`v` iff :math:`s_v \ge s_{(k)}`, the k-th largest of the survivors
   (every token tied with it stays, so more than k may; fewer than k survivors: all stay);
3. top-p: with :math:`q` the softmax over the survivors :math:`A`, keep :math:`v` iff the mass
   above it is below p, :math:`G(s_v) = \sum_{u \in A,\ s_u > s_v} q_u < p`.

Each step keeps the tokens at or above a value, so the kept set is :math:`K = \{v : s_v \ge f\}`
for one floor :math:`f` per row (:func:`support_floor`), and the processed log-prob is

.. math:: \log \pi^K(y) = s_y - \log \sum_{v \in K \cup \{y\}} e^{s_v}.

The chosen token joins the set: a token the sampler could not have drawn (its and the
trainer's numerics differ at the boundary) gets a finite log-prob, not ``-inf``, and
:func:`outside` reports it. The floor is a constant of the gradient.

Where ours differs from vLLM's: ties at the top-p boundary keep the whole tie group (vLLM's
sort decides which of the tied tokens go), and sums run in another order, so a token within a
rounding of a threshold may land on the other side. A top-p of 1 is off (vLLM still drops
tokens whose float32 probability is 0 when a neighbouring row of its batch has top-p on).

Cost: min-p needs the row max; top-k a top-k of the row's group maxima and one of the k
best groups (:func:`top_k_values`); top-p after a top-k the k kept values and one masked sum
over the row; a top-p without a top-k searches the floor by bisection over the float32
values, 33 masked sums over the row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from grpo_kernels.config import check_sampler_truncation
from grpo_kernels.ops.core.online_softmax import finish

Array = jax.Array
_F32 = jnp.float32
# Bisection over the 2^32 float32 bit patterns: 33 halvings find the least one.
_BISECT_STEPS = 33
# Columns per group of :func:`top_k_values`' first stage.
TOP_K_GROUP = 16


@dataclasses.dataclass(frozen=True)
class Truncation:
    """The sampler's restriction of each row (None: off).

    Attributes:
      top_k: Keep the ``top_k`` largest (and their ties); an int >= 1.
      top_p: Keep the smallest top set whose probability reaches ``top_p``; in ``(0, 1]``
        (1: off).
      min_p: Keep the tokens whose probability is at least ``min_p`` times the row's largest;
        in ``[0, 1]`` (0: off).
    """

    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def __post_init__(self) -> None:
        check_sampler_truncation(self.top_k, self.top_p, self.min_p)

    def active(self, vocab: int) -> bool:
        """Whether any of the three can drop a token of a ``vocab``-wide row."""
        return ((self.top_k is not None and self.top_k < vocab)
                or (self.top_p is not None and self.top_p < 1)
                or (self.min_p is not None and self.min_p > 0))


def config_truncation(config: Any, vocab: int) -> Truncation | None:
    """The truncation a loss config (``top_k``, ``top_p``, ``min_p``) asks for over a
    ``vocab``-wide row, or None when it drops nothing."""
    trunc = Truncation(config.top_k, config.top_p, config.min_p)
    return trunc if trunc.active(vocab) else None


def outside_count(outside: Array, mask: Array) -> Array:
    """The number of unmasked tokens a truncation would have dropped (float32): the loss
    metric ``outside_truncation``."""
    return jnp.sum(jnp.where((mask > 0) & outside.reshape(mask.shape), 1.0, 0.0))


def _key(x: Array) -> Array:
    """float32 -> uint32, order-preserving (-inf lowest, +inf highest; no NaN in a row)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_key(k: Array) -> Array:
    bits = jnp.where(k >> 31 == 1, k & jnp.uint32(0x7FFFFFFF), ~k)
    return jax.lax.bitcast_convert_type(bits, _F32)


def _mass_above_each(vals: Array, e: Array) -> Array:
    """For descending ``vals [..., k]`` with weights ``e``: the weight of the values strictly
    greater than each (a tie group shares its first member's exclusive prefix sum)."""
    excl = jnp.cumsum(e, axis=-1) - e
    idx = jax.lax.broadcasted_iota(jnp.int32, vals.shape, vals.ndim - 1)
    new = jnp.concatenate([jnp.ones_like(vals[..., :1], bool),
                           vals[..., 1:] != vals[..., :-1]], axis=-1)
    first = jax.lax.cummax(jnp.where(new, idx, 0), axis=vals.ndim - 1)
    return jnp.take_along_axis(excl, first, axis=-1)


def _whole_top_k(x: Array, k: int, output: int) -> Array:
    """Output ``output`` of ``lax.top_k`` (0: values, 1: indices) behind a barrier: where only
    a slice of its values is used, XLA folds the slice into the sort it expands top-k to and
    sorts every row whole (XLA:CPU: 80x slower than its top-k call at V = 32,768). One output
    alone goes through the barrier: with both, XLA:CPU's simplifier folds the pair back into the
    top-k itself, which its top-k decomposer then fails on (a CHECK abort under a partitioned
    ``jit``)."""
    return jax.lax.optimization_barrier(jax.lax.top_k(x, k)[output])


def top_k_values(s: Array, k: int, group: int = TOP_K_GROUP) -> Array:
    r"""The ``k`` largest values of each row of ``s [..., V]``, descending (ties repeated).

    In two stages: the row's maxima over groups of ``group`` columns, the ``k`` groups of the
    largest maxima, and the ``k`` largest of their ``k * group`` values. Exact: with
    :math:`t_0` the k-th largest group maximum, at least k values are :math:`\ge t_0`, so the
    k-th largest value is too, and every value above :math:`t_0` lies in one of the ``k``
    groups. The top-k that follow are over ``V / group`` and ``k * group`` values instead of
    ``V``. Rows of fewer than ``4 k`` groups take one top-k.
    """
    *lead, vocab = s.shape
    blocks = -(-vocab // group)
    if blocks < 4 * k:
        return _whole_top_k(s, k, 0)
    pad = blocks * group - vocab
    if pad:
        s = jnp.pad(s, [(0, 0)] * len(lead) + [(0, pad)], constant_values=-jnp.inf)
    x = s.reshape(*lead, blocks, group)
    idx = _whole_top_k(jnp.max(x, axis=-1), k, 1)
    cand = jnp.take_along_axis(x, idx[..., None], axis=-2).reshape(*lead, k * group)
    return _whole_top_k(cand, k, 0)


def _top_p_floor_bisect(s: Array, e: Array, target: Array, lo: Array, m: Array) -> Array:
    """The least float ``x`` in ``[lo, m]`` with ``sum(e[s > x]) < target`` (per row)."""

    def step(_, bounds):
        a, b = bounds
        mid = a + (b - a) // 2
        above = jnp.sum(jnp.where(s > _from_key(mid)[..., None], e, 0.0), axis=-1)
        ok = above < target
        return jnp.where(ok, a, mid + 1), jnp.where(ok, mid, b)

    a, b = jax.lax.fori_loop(0, _BISECT_STEPS, step, (_key(lo), _key(m)))
    return _from_key(b)


def _min_p_floor(m: Array, trunc: Truncation) -> Array:
    if trunc.min_p is not None and trunc.min_p > 0:
        return m + jnp.log(jnp.float32(trunc.min_p))
    return jnp.full(m.shape, -jnp.inf, _F32)


def _uses_top_p(trunc: Truncation) -> bool:
    return trunc.top_p is not None and trunc.top_p < 1


def _listed_floor(vals: Array, floor: Array, m_safe: Array, trunc: Truncation,
                  extra: Array) -> Array:
    """The floor after top-p from descending values ``vals [..., k]`` that hold every value
    above ``floor`` (min-p's and top-k's) and ``extra``: the weight :math:`e^{s - m}` of the
    row's values at ``floor`` beyond them (ties at the k-th)."""
    if not _uses_top_p(trunc):
        return floor
    ev = jnp.where(vals >= floor[..., None], jnp.exp(vals - m_safe[..., None]), 0.0)
    target = jnp.float32(trunc.top_p) * (jnp.sum(ev, axis=-1) + extra)
    kept = (_mass_above_each(vals, ev) < target[..., None]) & (vals >= floor[..., None])
    return jnp.maximum(floor, jnp.min(jnp.where(kept, vals, jnp.inf), axis=-1))


def support_floor(s: Array, trunc: Truncation, by_sorting: bool = False) -> Array:
    """The floor :math:`f` of each row of float32 scaled logits ``s [..., V]``: the kept set
    is ``s >= f`` (module docstring); ``-inf`` where nothing is dropped.

    ``by_sorting``: from each row sorted whole (the reference's way; memory and time of a
    sort of ``[..., V]``). Otherwise top-k by :func:`top_k_values` and a top-p without a
    top-k by bisection (:func:`_top_p_floor_bisect`), never a sorted copy of the row.
    """
    vocab = s.shape[-1]
    m = jnp.max(s, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    floor = _min_p_floor(m, trunc)
    topk = trunc.top_k is not None and trunc.top_k < vocab
    if not topk and not _uses_top_p(trunc):
        return floor
    if by_sorting:
        vals = -jnp.sort(-s, axis=-1)
        if topk:
            floor = jnp.maximum(floor, vals[..., trunc.top_k - 1])
        return _listed_floor(vals, floor, m_safe, trunc, jnp.zeros(floor.shape, _F32))
    if topk:
        k = trunc.top_k
        vals = top_k_values(s, k + 1)  # k < V
        floor = jnp.maximum(floor, vals[..., k - 1])
        # values at the floor beyond the k (ties at the k-th) count towards top-p's mass
        extra = _ties_beyond(s, vals, floor, m_safe, k) if _uses_top_p(trunc) else 0.0
        return _listed_floor(vals[..., :k], floor, m_safe, trunc, extra)
    e = jnp.where(s >= floor[..., None], jnp.exp(s - m_safe[..., None]), 0.0)
    target = jnp.float32(trunc.top_p) * jnp.sum(e, axis=-1)
    return jnp.maximum(floor, _top_p_floor_bisect(s, e, target, floor, m))


def _ties_beyond(s: Array, vals: Array, floor: Array, m_safe: Array, k: int) -> Array:
    """The weight :math:`e^{s - m}` of each row's values equal to its k-th largest
    ``vals[k - 1]`` beyond the ``k`` listed, where the floor is that value and the listed
    ``(k+1)``-th equals it (else 0): a pass over the row, taken only where some row of ``s``
    needs it."""
    kth = vals[..., k - 1]
    listed = jnp.sum((vals[..., :k] == kth[..., None]).astype(jnp.int32), axis=-1)
    need = (floor == kth) & (vals[..., k] == kth)

    def count(s):
        return jnp.sum((s == kth[..., None]).astype(jnp.int32), axis=-1) - listed

    # listed * 0, not a fresh zeros: under shard_map both branches vary over the same axes
    n = jax.lax.cond(jnp.any(need), count, lambda s: listed * 0, s)
    return jnp.where(need, n, 0).astype(_F32) * jnp.exp(kth - m_safe)


def listed_stats(s: Array, chosen: Array, trunc: Truncation) -> tuple[Array, ...]:
    r"""``(floor, logp, lse, entropy, outside)`` of each row of ``s [..., V]`` under a
    truncation with a top-k (``trunc.top_k < V``), from the row's ``k + 1`` largest values
    alone: the kept set lies among them (with the k-th value's ties, counted in a pass over
    the row only where they run past the list), so its sums

    .. math:: S = \sum_{v \in K} e^{s_v - m}, \qquad Q = \sum_{v \in K} e^{s_v - m}(s_v - m)

    (and the chosen token's term where it lies below the floor) take ``O(k)`` per row after
    the top-k, and no masked pass over the row exists. ``chosen``: the chosen ids' scaled
    logits.
    """
    k = trunc.top_k
    vals = top_k_values(s, k + 1)  # k < V
    m = vals[..., 0]
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    floor = jnp.maximum(_min_p_floor(m, trunc), vals[..., k - 1])
    extra = _ties_beyond(s, vals, floor, m_safe, k)
    floor = _listed_floor(vals[..., :k], floor, m_safe, trunc, extra)
    top = vals[..., :k]
    e = jnp.where(top >= floor[..., None], jnp.exp(top - m_safe[..., None]), 0.0)
    u = top - m_safe[..., None]
    at_floor = floor == vals[..., k - 1]  # the ties beyond the list are kept
    kth_u = vals[..., k - 1] - m_safe
    extra = jnp.where(at_floor, extra, 0.0)
    out = outside(chosen, floor)
    ey = jnp.where(out, jnp.exp(chosen - m_safe), 0.0)
    total = jnp.sum(e, axis=-1) + extra + ey
    q = (jnp.sum(jnp.where(e > 0, e * u, 0.0), axis=-1)
         + jnp.where(extra > 0, extra * kth_u, 0.0)
         + jnp.where(ey > 0, ey * (chosen - m_safe), 0.0))
    return (floor, *finish(m_safe, total, q, chosen), out)


def drop_outside(u: Array, s: Array, floor: Array, hit: Array | bool) -> Array:
    """``u`` where the scaled logits ``s`` are kept (at or above ``floor``, which broadcasts
    against ``s`` as given: ``floor[..., None]`` for a row's floor, a ``[rows, 1]`` column in a
    kernel; or the chosen token, ``hit``, a mask of the shape of ``s``, ``False``: none),
    ``-inf`` elsewhere: the dropped tokens' ``p = e^{u}`` is 0 in a gradient formed from
    ``u = s - lse``."""
    return jnp.where((s >= floor) | hit, u, -jnp.inf)


def truncate(s: Array, floor: Array, hit: Array | bool) -> Array:
    """``s [..., V]`` with the entries below the row's ``floor [...]`` (but ``hit``) at
    ``-inf`` (:func:`drop_outside`)."""
    return drop_outside(s, s, floor[..., None], hit)


def outside(s_chosen: Array, floor: Array) -> Array:
    """Whether the chosen token's scaled logit ``s_chosen`` lies below its row's floor: a
    token the sampler's truncation would not have kept."""
    return s_chosen < floor
