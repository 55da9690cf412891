r"""The fused XLA head's passes over blocks of vocabulary columns (every token at once), and
the 16-bit slab writes they and the tied lookup share.

:func:`vocab_stats` forms the rows' softmax statistics a block of columns at a time,
:func:`vocab_sweep` the weight gradient a block at a time (``LmHeadBlockSizes.dweight =
"vocab"``: no ``[H, V]`` float32 accumulator, one more matmul of the logits' size), each
block of ``W`` gathered over FSDP axes when used and its gradient reduce-scattered back
(:func:`_gather_block`, :func:`_scatter_block`). :func:`in_slabs` writes a 16-bit array by
``uint16`` slabs so that XLA:CPU never widens it to float32; docs/lm_head.md has the
measurements.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from grpo_kernels.compat import vary_like
from grpo_kernels.objective import RowGrad
from grpo_kernels.ops.core.online_softmax import block_stats, finish, merge_stats, sweep
from grpo_kernels.ops.lm_head_loss.head import matmul
from grpo_kernels.ops.lm_head_loss.xla_sweep import (Head, _as_bits, _from_bits, _slice_rows,
                                                     logits_delta)

Array = jax.Array
_F32 = jnp.float32


# Slabs of a 16-bit gradient written by blocks (in_slabs): one rewrite of the whole each.
DWEIGHT_SLABS = 8


def in_slabs(n: int, block: int, out: Array, axis: int,
             fill: Callable[[Any, int, Array, Any], tuple[Array, Any]], carry: Any,
             like: tuple[Any, ...] = (), keep: bool = False) -> tuple[Array, Any]:
    """``out`` (16-bit) written along ``axis`` over ``[0, n)``, in slabs of whole ``block``s.

    ``fill(start, width, bits, carry) -> (bits, carry)`` fills ``bits``, a ``uint16`` slab of
    ``width`` along ``axis`` that starts at ``start`` of ``out`` (zeros, or with ``keep`` the
    bit patterns ``out`` holds there), by blocks (in place:
    XLA:CPU widens a bfloat16 update-slice to float32 and rewrites the whole array, an integer
    one it does not). Each finished slab goes into ``out`` by one update. A whole-``out``
    integer view would instead be turned back into floats by a copy of ``out`` (XLA:CPU
    shares a buffer only between arrays of one element type): this way the extra memory is
    at most two slabs (``2 / DWEIGHT_SLABS`` of ``out``), for :data:`DWEIGHT_SLABS` rewrites.
    """
    slab = -(-n // DWEIGHT_SLABS // block) * block

    def put(start, width, c):
        out, carry = c
        shape = out.shape[:axis] + (width,) + out.shape[axis + 1:]
        bits = (jax.lax.dynamic_slice_in_dim(_as_bits(out), start, width, axis) if keep
                else vary_like(jnp.zeros(shape, jnp.uint16), *like))
        bits, carry = fill(start, width, bits, carry)
        return jax.lax.dynamic_update_slice_in_dim(out, _from_bits(bits, out.dtype), start,
                                                   axis), carry

    return sweep(n, min(slab, n), put, (out, carry), like=like)


def _gather_block(w: Array, head: Head, fsdp: tuple[str, ...]) -> Array:
    """A block of the head's columns with its whole hidden dimension: ``w`` as sliced, or,
    when ``H`` is split over the mesh axes ``fsdp`` (inside ``shard_map``), gathered over
    them."""
    if not fsdp:
        return w
    return jax.lax.all_gather(w, fsdp, axis=0 if head.layout == "hv" else 1, tiled=True)


def _scatter_block(upd: Array, head: Head, fsdp: tuple[str, ...]) -> Array:
    """A float32 block of ``dW`` summed over the mesh axes ``fsdp``, each device keeping its
    own rows of ``H`` (the transpose of :func:`_gather_block`)."""
    if not fsdp:
        return upd
    return jax.lax.psum_scatter(upd, fsdp, scatter_dimension=0 if head.layout == "hv" else 1,
                                tiled=True)


def vocab_stats(h: Array, ids: Array, head: Head, temperature: float, cols: int,
                fsdp: tuple[str, ...] = ()) -> tuple[Array, Array, Array]:
    r"""``(logp, lse, entropy)`` ``[N]`` of every token, in one pass over blocks of ``cols``
    vocabulary columns: per block :math:`s_{\mathcal{B}} = (h W_{\mathcal{B}} +
    b_{\mathcal{B}}) / \tau` for all ``N`` tokens (``[N, cols]``), its ``(m, S, Q)`` merged
    online into the rows' (:func:`merge_stats`) and the chosen logit picked where the block
    holds it (``ids`` in ``[0, V)`` of this head).

    The vocabulary-major order of :func:`head_sweep`'s statistics: what a head whose ``H`` is
    split over the mesh axes ``fsdp`` needs, since each block's weights are gathered once
    (:func:`_gather_block`) and no device holds the whole ``[H, V]``.
    """
    n = h.shape[0]
    axis = 1 if head.layout == "hv" else 0

    def body(col, width, carry):
        stats, chosen, w = carry
        # W rides in the loop's state through a barrier, as in vocab_sweep: else XLA hoists
        # W's integer view (a whole copy) out of the loop.
        w_now, stats = jax.lax.optimization_barrier((w, stats))
        w_block = _gather_block(_slice_rows(w_now, col, width, axis=axis), head, fsdp)
        bias = None if head.bias is None else jax.lax.dynamic_slice_in_dim(head.bias, col, width)
        s = head.scores(dataclasses.replace(head, w=w_block, bias=bias).logits(h), temperature)
        hit = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1) == (ids - col)[:, None]
        chosen = chosen + jnp.sum(jnp.where(hit, s, 0.0), axis=1)
        return merge_stats(stats, block_stats(s)), chosen, w

    init = ((jnp.full((n,), -jnp.inf, _F32), jnp.zeros((n,), _F32), jnp.zeros((n,), _F32)),
            jnp.zeros((n,), _F32), head.w)
    stats, chosen, _ = sweep(head.vocab, min(cols, head.vocab), body, init,
                             like=(h, ids, head.w))
    return finish(*stats, chosen)


def vocab_sweep(h: Array, ids: Array, head: Head, temperature: float, lse: Array,
                row: RowGrad, cols: int, fsdp: tuple[str, ...] = (),
                with_dh: bool = False,
                floor: Array | None = None) -> tuple[Array, Array | None, Array | None]:
    r"""``dW`` and ``db`` (and ``dh``) in one pass over blocks of ``cols`` vocabulary columns,
    every token at once, given each token's ``lse`` and
    :class:`~grpo_kernels.objective.RowGrad` (``[N]`` arrays, from a token pass).

    Per block :math:`\mathcal{B}`: :math:`z_{\mathcal{B}} = h W_{\mathcal{B}} + b_{\mathcal{B}}`
    (``[N, cols]``, rounded as the logits are), :math:`\delta` of :func:`logits_delta`
    (without an entropy term :math:`\frac{g}{\tau}(\mathbb{1}[v = y]
    - e^{s - \mathrm{lse}})`), :math:`\partial L/\partial W_{\mathcal{B}} = h^\top \delta` and
    :math:`\partial L/\partial b_{\mathcal{B}} = \sum_n \delta_n` (and, ``with_dh``,
    :math:`\partial L/\partial h \mathrel{+}= \delta W_{\mathcal{B}}^\top` into an ``[N, H]``
    float32 sum): each block of the weight gradient is summed over all ``N`` tokens inside one
    float32 matmul and rounded to the weight dtype once, so no ``[H, V]`` float32 accumulator
    exists. The price is the logits' matmul a second time (four matmuls of the logits' size
    per step instead of three).

    ``fsdp``: mesh axes (inside ``shard_map``) over which ``W``'s hidden dimension is split:
    each block is gathered over them before use and its float32 ``dW`` summed back over them
    by a reduce-scatter, so ``dW`` comes back as this device's ``W`` shard's gradient and no
    device holds more than one block of the whole ``W``. ``floor``: each token's floor under a
    sampler's truncation (:func:`logits_delta`).

    16-bit blocks go into ``dW`` through :func:`in_slabs` (no weight-sized copy on XLA:CPU),
    float32 ones directly. The loop passes ``W`` through an ``optimization_barrier`` with its
    state, so that XLA does not hoist ``W``'s integer view (a whole copy) out of it.

    Returns:
      ``(dW in W's dtype and layout, db float32 or None, dh [N, H] float32 or None)``.
    """
    vocab, axis = head.vocab, (1 if head.layout == "hv" else 0)
    coef = row.map(lambda x: x.astype(_F32)).over(temperature)
    dtype = head.w.dtype
    # W enters the sweep through a barrier with lse, which the statistics pass produced: else
    # XLA:CPU from jaxlib 0.12 may schedule this pass's first gathered block (it depends on W
    # alone) before that pass's last one is freed, two gathered blocks live at once.
    w_after, lse = jax.lax.optimization_barrier((head.w, lse))

    def block(col, width, w, dh):
        """``(dW, db, dh)`` of the columns ``col .. col + width``, dW in its layout and dtype."""
        bias = None if head.bias is None else jax.lax.dynamic_slice_in_dim(head.bias, col, width)
        w_block = _gather_block(_slice_rows(w, col, width, axis=axis), head, fsdp)
        part = dataclasses.replace(head, w=w_block, bias=bias)
        s = part.scores(part.logits(h), temperature)
        delta = logits_delta(s, ids, coef, lse, head, col, temperature, floor)
        if head.layout == "hv":
            upd = matmul(h, delta, ((0,), (0,)))  # [H, cols]
        else:
            upd = matmul(delta, h, ((0,), (0,)))  # [cols, H]
        if dh is not None:
            dh = dh + part.dhidden(delta)
        upd = _scatter_block(upd, head, fsdp).astype(dtype)
        return upd, None if head.bias is None else jnp.sum(delta.astype(_F32), 0), dh

    like = (h, ids, head.w, lse, row.g)

    def columns(offset, width, dw, carry):
        """Blocks of ``cols`` columns over ``offset .. offset + width`` into ``dw`` (whose
        column 0 is column ``offset`` of ``dW``: a slab, or the whole at offset 0), ``db`` and
        ``dh``; 16-bit blocks through an integer view (``dw`` is one)."""
        def body(col, size, carry):
            dw, db, dh, w = carry
            # The barrier ties W to the loop's state: without it XLA hoists W's integer view
            # (a whole copy) out of the loop; with it each block's slice reads W in place.
            w_now, dw = jax.lax.optimization_barrier((w, dw))
            upd, dbb, dh = block(offset + col, size, w_now, dh)
            dw = jax.lax.dynamic_update_slice_in_dim(dw, _as_bits(upd), col, axis)
            if db is not None:
                db = jax.lax.dynamic_update_slice_in_dim(db, dbb, offset + col, 0)
            return dw, db, dh, w

        dw, db, dh, _ = sweep(width, min(cols, width), body, (dw, *carry, w_after), like=like)
        return dw, (db, dh)

    dw = vary_like(jnp.zeros(head.w.shape, dtype), *like)
    db = None if head.bias is None else vary_like(jnp.zeros((vocab,), _F32), *like)
    dh = vary_like(jnp.zeros(h.shape, _F32), *like) if with_dh else None
    if dtype.itemsize != 2:
        dw, (db, dh) = columns(0, vocab, dw, (db, dh))
    else:
        dw, (db, dh) = in_slabs(vocab, min(cols, vocab), dw, axis, columns, (db, dh), like)
    return dw, db, dh
