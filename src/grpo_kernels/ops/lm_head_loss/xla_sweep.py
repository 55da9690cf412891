r"""The chunk loop of the fused XLA LM-head loss (:mod:`.xla` has the math and the entry).

:func:`head_sweep` runs one pass over chunks of tokens: the chunk's logits from one matmul,
their online-softmax statistics, and, in a gradient pass, ``delta``, ``dh``, ``dW`` and ``db``.
The rest of this module is what makes that loop fast and narrow on XLA:CPU (16-bit slicing
through integer views, bfloat16 rounding that fuses, ``dW`` in row blocks); docs/lm_head.md
records the measurements behind each choice.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from grpo_kernels.compat import vary_like
from grpo_kernels.ops.core.dtypes import cast_to
from grpo_kernels.objective import RowGrad
from grpo_kernels.ops.core.online_softmax import block_stats, finish, merge_stats, sweep
from grpo_kernels.ops.core.online_softmax import soft_cap, softmax_grad, with_cap_grad
from grpo_kernels.ops.core.truncation import (Truncation, drop_outside, listed_stats, outside,
                                              support_floor, truncate)
from grpo_kernels.ops.lm_head_loss.head import delta_dtype, matmul

Array = jax.Array
_F32 = jnp.float32


# Veltkamp's splitting constant for float32 -> bfloat16: 2^(24 - 8) + 1.
_SPLIT = 65537.0
# Beyond this magnitude _SPLIT * x could overflow float32 (at 2^111); such values pass unrounded.
_SPLIT_LIMIT = 2.0 ** 100


def round_to_bfloat16(x: Array) -> Array:
    r"""float32 ``x`` rounded to the nearest bfloat16 (ties to even), kept in float32.

    Veltkamp's splitting: with :math:`C = 2^{16} + 1` and float32 arithmetic,

    .. math:: c = C x, \qquad \mathrm{hi} = c - (c - x)

    is ``x`` rounded to :math:`24 - 16 = 8` significant bits, bfloat16's precision. Three float
    operations, which XLA:CPU fuses into the consumers (the softmax reductions read the matmul
    output directly); the integer form of :func:`grpo_kernels.ops.core.dtypes.to_bfloat16`
    is not fused there, and its float32 result was materialised as a whole ``[c, V]`` copy.
    Equal to ``x.astype(bfloat16).astype(float32)`` for every normal float32 ``|x| < 2^100``
    (tested over random values, every tie and its neighbours; XLA:CPU flushes subnormals to
    zero); infinities, NaN and ``|x| >= 2^100`` pass unchanged (no logit is that large). A
    compiler that reassociated float arithmetic would drop the rounding, not corrupt the value.
    """
    c = x * jnp.float32(_SPLIT)
    return jnp.where(jnp.abs(x) < jnp.float32(_SPLIT_LIMIT), c - (c - x), x)


@dataclasses.dataclass(frozen=True)
class Head:
    """The LM head: weights in one of two layouts, an optional bias, the logits dtype, and
    whether the program is planned for XLA:CPU (its workarounds: bfloat16 logits held as
    rounded float32, statistics over vocabulary blocks; the ``dW`` row blocks come with the
    sweep's ``dw_rows``)."""

    w: Array
    bias: Array | None
    layout: str
    logits_dtype: Any
    cpu: bool
    softcap: float | None = None

    def scores(self, z: Array, temperature: float) -> Array:
        """``s``: the logits ``z`` (from :meth:`logits`) soft-capped, over the temperature,
        float32."""
        return soft_cap(z.astype(_F32), self.softcap) / temperature

    @property
    def vocab(self) -> int:
        return self.w.shape[1] if self.layout == "hv" else self.w.shape[0]

    def logits(self, h: Array) -> Array:
        """``cast(h W + b)`` for rows ``h [c, H]``: float32 accumulation, one rounding.

        bfloat16 logits on CPU (``self.cpu``) come back as float32 arrays holding the rounded
        values (:func:`round_to_bfloat16`), which XLA:CPU fuses into the softmax reductions.
        """
        k = 0 if self.layout == "hv" else 1
        z = matmul(h, self.w, ((1,), (k,)))
        if self.bias is not None:
            z = z + self.bias.astype(_F32)[None, :]
        dtype = jnp.dtype(self.logits_dtype)
        if dtype == _F32:
            return z
        if dtype == jnp.bfloat16 and self.cpu:
            return round_to_bfloat16(z)
        return cast_to(z, dtype)

    def dhidden(self, delta: Array) -> Array:
        """``delta W^T`` for ``delta [c, V]``: ``[c, H]`` float32."""
        k = 1 if self.layout == "hv" else 0
        return matmul(delta, self.w, ((1,), (k,)))


# Vocabulary columns per block of a chunk's softmax statistics on CPU (elsewhere whole rows).
CPU_STATS_BLOCK = 4096


def chunk_stats(s: Array, block: int | None,
                scores: Callable[[Array], Array] | None = None) -> tuple[Array, Array, Array]:
    """``(m, S, Q)`` of each row of ``s [c, V]`` (:func:`block_stats`), over vocabulary blocks
    of ``block`` columns merged online (:func:`merge_stats`); ``None``: whole rows at once.
    With ``scores``, ``s`` holds the logits and each block's scores are ``scores(block)``,
    converted where the reduction reads them.

    On CPU the entropy's two sums over a whole row made XLA materialise ``exp(s - m)`` and
    ``exp(s - m) (s - m)`` as two float32 ``[c, V]`` arrays; over 4096-column blocks those are
    small, and the chunk's temporaries drop without losing time (docs/lm_head.md).
    """
    rows, vocab = s.shape
    to_scores = scores or (lambda x: x)
    if block is None or vocab <= block:
        return block_stats(to_scores(s))

    def body(col, width, acc):
        return merge_stats(acc, block_stats(to_scores(
            jax.lax.dynamic_slice_in_dim(s, col, width, axis=1))))

    init = (jnp.full((rows,), -jnp.inf, _F32), jnp.zeros((rows,), _F32),
            jnp.zeros((rows,), _F32))
    return sweep(vocab, block, body, init, like=(s,))


def rows_of(x: Array | None, start: Any, size: int) -> Array | None:
    return None if x is None else jax.lax.dynamic_slice_in_dim(x, start, size)


def _as_bits(x: Array) -> Array:
    """A same-width unsigned view of 16-bit floats (XLA:CPU has no bfloat16 update-slice)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 else x


def _from_bits(x: Array, dtype: Any) -> Array:
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != jnp.dtype(dtype) else x


def _slice_rows(x: Array, start: Any, size: int, axis: int = 0) -> Array:
    """``x[start:start+size]`` along ``axis``; 16-bit floats through an integer view."""
    return _from_bits(jax.lax.dynamic_slice_in_dim(_as_bits(x), start, size, axis=axis), x.dtype)


def take_rows(x: Array, idx: Array) -> Array:
    """``x[idx]`` along axis 0; 16-bit floats through an integer view."""
    return _from_bits(jnp.take(_as_bits(x), idx, axis=0), x.dtype)


# grad_fn(start, size, logp, entropy) of a chunk of rows -> its RowGrad.
GradFn = Callable[[Any, int, Array, Array], RowGrad]
# then(stats, (dh_bits, dW [H, V] float32 or None, db or None)) -> the same gradients.
ThenFn = Callable[[tuple[Array, Array, Array], tuple], tuple]

def _accumulate_dweight(dw: Array, hc_t: Array, delta: Array, rows: int) -> Array:
    """``dw += h^T delta`` over blocks of ``rows`` rows of ``dw``, in place.

    ``dw`` is ``[H, V]`` whatever the head's layout: ``hc_t`` (the chunk's ``h^T``,
    materialised: ``[H, c]``) is sliced into ``[rows, c]`` blocks, each times the whole
    ``delta [c, V]``, the plain ``[M, K] x [K, N]`` form that XLA:CPU hands to its fast matmul
    library. Blocking keeps the float32 product small (a whole ``[H, V]`` product per chunk
    would be a second accumulator-sized buffer), and blocking over rows rather than vocabulary
    columns leaves ``delta`` unsliced: XLA:CPU slices 16-bit floats only through an integer
    view, and ``delta`` in two types was computed twice, with ``exp`` materialised in float32
    between (docs/lm_head.md). The ``"vh"`` form ``delta^T h`` contracts the rows of both
    operands and ran slower there; its ``[V, H]`` result is one transpose of the
    accumulator at the end.
    """
    def body(row, height, acc):
        upd = matmul(_slice_rows(hc_t, row, height), delta, ((1,), (0,)))
        old = jax.lax.dynamic_slice(acc, (row, 0), upd.shape)
        return jax.lax.dynamic_update_slice(acc, old + upd, (row, 0))

    return sweep(dw.shape[0], min(rows, dw.shape[0]), body, dw, like=(hc_t, delta))


def logits_delta(s: Array, ids: Array, row: RowGrad, lse: Array, head: Head,
                 col: Any = 0, temperature: float = 1.0,
                 floor: Array | None = None) -> Array:
    r"""``delta = dL/ds`` for the rows of ``s [r, w]``, whose columns are the vocabulary's
    ``col .. col + w``: :func:`softmax_grad` of ``u = s - lse`` with the per-row factors of
    ``row`` (``[r]`` arrays, already over ``tau``); without an entropy term
    ``g (1[v = y] - e^{u})``. In the dtype the two gradient matmuls take
    (:func:`delta_dtype`). An id outside the columns (``-1``: a vocabulary shard that does not
    own it) has no one-hot term. A soft-capped head's ``delta`` is w.r.t. the uncapped logits:
    times the cap's derivative at ``s * temperature``, the capped logits. With the rows'
    ``floor`` (a sampler's truncation) the entries below it but the chosen one have ``p = 0``."""
    hit = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1) == (ids - col)[:, None]
    r = row.map(lambda x: x[:, None])
    u = s - lse[:, None]
    if floor is not None:
        u = drop_outside(u, s, floor[:, None], hit)
    d = softmax_grad(u, hit, r.g, r.h, r.entropy)
    d = with_cap_grad(d, s * temperature, head.softcap)
    return cast_to(d, delta_dtype(head.logits_dtype, head.w.dtype))


def head_sweep(h: Array, ids: Array, head: Head, temperature: float, rows: int,
               grad_fn: GradFn | None, dw_rows: int | None = None,
               lse: Array | None = None,
               reduce_dh: Callable[[Array], Array] | None = None,
               dweight: bool = True,
               then: ThenFn | None = None,
               seq: tuple[str, int] | None = None,
               trunc: Truncation | None = None,
               floor: Array | None = None,
               ) -> tuple[tuple[Array, ...], Any]:
    """One pass over chunks of ``rows`` tokens.

    Args:
      h: ``[N, H]`` hidden states.
      ids: ``[N]`` int32 chosen ids in ``[0, V)``; in a gradient pass an id of ``-1`` means
        "no column of this head" (a vocabulary shard that does not own the token, see
        :mod:`grpo_kernels.sharding`): its one-hot term is zero and its statistics are junk.
      head: The LM head.
      temperature: Softmax temperature.
      rows: Rows per chunk.
      grad_fn: ``None`` for statistics only; else ``grad_fn(start, size, logp_chunk,
        entropy_chunk)`` returns the chunk's :class:`~grpo_kernels.objective.RowGrad` and the
        pass also forms the gradients (an entropy term without ``entropy`` takes this pass's
        entropies).
      dw_rows: Rows of ``dW`` per update (:func:`dweight_rows` of the plan's platform);
        needed when the pass forms ``dW`` (``grad_fn`` given and ``dweight``).
      lse: ``[N]`` logsumexp to use in the gradient instead of the one of these columns (the
        whole-row value when the head is a vocabulary shard); ``None``: this pass's own.
      reduce_dh: Applied to each chunk's float32 ``dh`` before it is stored: the ``psum`` over
        the vocab axis when the head is a vocabulary shard, so that no ``[N, H]`` partial sum
        is ever held (:mod:`grpo_kernels.sharding`).
      dweight: ``False``: a gradient pass forms ``dh`` only (``dW`` and ``db`` come back
        ``None``; :func:`vocab_sweep` forms them without the ``[H, V]`` float32 accumulator).
      seq: ``(axis, k)``: ``h`` is this device's ``[N / k, H]`` share of the rows, split over
        the mesh axis ``axis`` of size ``k`` (inside ``shard_map``, the vocab axis of a
        sequence-parallel head). Each chunk of ``rows`` (a multiple of ``k``) gathers
        ``rows / k`` rows from every device (``all_gather``), and its ``dh`` goes back summed
        over the axis, each device keeping its own rows (``psum_scatter``): the chunks visit the
        rows in the order of :func:`.xla.chunk_order`, which ``ids``, ``lse``, ``grad_fn`` and the
        returned statistics follow; ``dh`` comes back as ``h``'s ``[N / k, H]``. No
        ``[N, H]`` array exists on any device. Replaces ``reduce_dh``.
      then: Applied after the loop to the statistics and the gradients as the loop holds them
        (``dh`` as ``uint16`` bits for 16-bit ``h``, ``dW`` as ``[H, V]``), before they are
        put in their dtypes and layout (:mod:`.xla_quantile`'s correction).
      trunc: A sampler's truncation (a whole-vocabulary head, no ``seq``): each chunk finds
        its rows' floors (:func:`~grpo_kernels.ops.core.truncation.support_floor`) and
        truncates them; the statistics gain ``floor`` and ``outside`` (the id below it).
      floor: ``[N]`` floors found by such a pass, for the gradient pass.

    Returns:
      ``((logp, lse, entropy), grads)``: three ``[N]`` float32 vectors (five with ``trunc``:
      and ``floor`` float32, ``outside`` bool), and ``None`` or
      ``(dh [N, H] in h's dtype, dW float32 in W's layout, db [V] float32 or None)``.
    """
    parts = 1 if seq is None else seq[1]
    n, hidden = h.shape[0] * parts, h.shape[1]
    vocab = head.vocab
    if grad_fn is not None and dweight and dw_rows is None:
        raise ValueError("head_sweep: a pass that forms dW needs dw_rows (dweight_rows)")
    stats_block = CPU_STATS_BLOCK if head.cpu else None
    # a statistics pass under a top-k needs no pass over the truncated rows (listed_stats)
    listed = (trunc is not None and grad_fn is None and trunc.top_k is not None
              and trunc.top_k < vocab)

    def chunk(start, size, carry):
        stats, grads = carry
        hc = _slice_rows(h, start // parts, size // parts)
        if seq is not None:
            hc = jax.lax.all_gather(hc, seq[0], axis=0, tiled=True)
        idc = jax.lax.dynamic_slice_in_dim(ids, start, size)
        z = head.logits(hc)
        if z.dtype.itemsize < 4:  # keep the rounded logits narrow; consumers upcast on the fly
            z = jax.lax.optimization_barrier(z)
        s = head.scores(z, temperature)
        # The chosen logits and the untruncated statistics read the 16-bit logits and convert
        # them where they use them: sharing the float32 scores between them, libtpu 0.0.48
        # (jax 0.11) materialises them, a float32 [rows, V] per chunk (5.83 GB against 3.69
        # planned for a v6e at T = 8,192, H = 4,096, V = 151,936; docs/lm_head.md).
        chosen = head.scores(jnp.take_along_axis(z, jnp.clip(idc, 0, vocab - 1)[:, None],
                                                 axis=1)[:, 0], temperature)
        extra, floor_c = (), rows_of(floor, start, size)
        if listed:  # the statistics from the k largest values alone
            floor_c, logp, lse_c, ent, out = listed_stats(s, chosen, trunc)
            extra = (floor_c, out)
        else:
            if trunc is not None:
                floor_c = support_floor(s, trunc)
                extra = (floor_c, outside(chosen, floor_c))
            if floor_c is None:
                st = chunk_stats(z, stats_block, lambda x: head.scores(x, temperature))
            else:
                hit = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1) == idc[:, None]
                st = chunk_stats(truncate(s, floor_c, hit), stats_block)
            logp, lse_c, ent = finish(*st, chosen)
        stats = tuple(jax.lax.dynamic_update_slice_in_dim(o, x, start, 0)
                      for o, x in zip(stats, (logp, lse_c, ent, *extra), strict=True))
        if grads is None:
            return stats, None
        dh_bits, dw, db = grads
        if lse is not None:
            lse_c = jax.lax.dynamic_slice_in_dim(lse, start, size)
        row = grad_fn(start, size, logp, ent)
        if row.h is not None and row.entropy is None:
            row = row._replace(entropy=ent)
        delta = logits_delta(s, idc, row.over(temperature), lse_c, head,
                             temperature=temperature, floor=floor_c)
        dhc = head.dhidden(delta)
        if seq is not None:
            dhc = jax.lax.psum_scatter(dhc, seq[0], scatter_dimension=0, tiled=True)
        elif reduce_dh is not None:
            dhc = reduce_dh(dhc)
        dh_bits = jax.lax.dynamic_update_slice_in_dim(dh_bits, _as_bits(dhc.astype(h.dtype)),
                                                      start // parts, 0)
        if dw is not None:
            dw = _accumulate_dweight(dw, jax.lax.optimization_barrier(hc.T), delta, dw_rows)
        if db is not None:
            db = db + jnp.sum(delta.astype(_F32), axis=0)
        return stats, (dh_bits, dw, db)

    # Inside shard_map the carries are typed like the data each is made of; a dh that is
    # summed over the vocab axis per chunk does not vary over it.
    like = (h, ids, head.w) + (() if lse is None else (lse,))
    stats0 = tuple(jnp.zeros((n,), _F32) for _ in range(3))
    if trunc is not None:
        stats0 = (*stats0, jnp.zeros((n,), _F32), jnp.zeros((n,), jnp.bool_))
    stats0 = vary_like(stats0, *like)
    if grad_fn is None:
        return sweep(n, rows, chunk, (stats0, None))[0], None
    dh_like = (h,) if reduce_dh is not None or seq is not None else like
    dw0, db0 = None, None
    if dweight:
        dw0 = vary_like(jnp.zeros((hidden, vocab), _F32), *like)
        db0 = None if head.bias is None else vary_like(jnp.zeros((vocab,), _F32), *like)
    dh0 = vary_like(_as_bits(jnp.zeros(h.shape, h.dtype)), *dh_like)
    stats, grads = sweep(n, rows, chunk, (stats0, (dh0, dw0, db0)))
    dh, dw, db = grads if then is None else then(stats, grads)
    dh = _from_bits(dh, h.dtype)
    return stats, (dh, dw if dw is None or head.layout == "hv" else dw.T, db)
