r"""The GPU kernels' ``"aligned"`` layout: 16-byte aligned tiles and no column ids inside them.

Same math and the same ``(N, tiles)`` grid as :mod:`~grpo_kernels.ops.logits_loss.pallas_gpu`'s
``"rows"`` layout, with two changes, both aimed at the rows layout's statistics kernel, which
read at about 1 TB/s on an H100, a third of the copy bandwidth (docs/kernels.md, "GPU: the
``"aligned"`` layout").

**Aligned tiles.** The logits are addressed as one flat ``[N V]`` array. Row ``r`` starts at
element ``r V``; its tiles start at the first 16-byte boundary after that,
``r V + h_r`` with ``h_r = (-r V) mod a`` and ``a = 16 / itemsize`` (8 for bf16, 4 for f32), so
every tile of every row loads and stores in 16-byte vectors whatever ``V`` is. With the row
layout an odd ``V`` (151,643) puts rows at odd byte offsets and every load is a 2-byte scalar.
Each row has ``F = (V - a + 1) // block_vocab`` full tiles; the ``h_r`` elements before them (the
*head*) and the ``V - h_r - F block_vocab`` after them (the *tail*) go to one masked program per
row, the *edge* call. The tail starts on a boundary too, so the edge call moves its whole
vectors in 16-byte vectors as well; only the head and the tail's last partial vector go
element by element.

**No column ids in the tiles.** A full tile never compares column ids with the chosen id:

- statistics: per tile only ``(m, S, Q)``, in base 2 (``t = s log2 e``, ``S = sum 2^{t - m_2}``,
  ``Q_2 = sum 2^{t - m_2} (t - m_2)``, then ``m = m_2 ln 2``, ``Q = Q_2 ln 2``), so each element
  costs one multiply and one ``ex2``. The chosen logit is gathered in XLA (``N`` values).
- gradient: a tile writes ``-p (c + c_h (u + H))``, the not-chosen case of
  :func:`~grpo_kernels.ops.core.online_softmax.softmax_grad`, with ``p = 2^{u log2 e}``. The edge
  program writes the chosen column's value, from the chosen logit gathered beforehand.

Compiled for sm_90 (Triton 3.6, at V = 151,643 bf16, 8192-column tiles, 4 warps) this takes the
statistics kernel from 255 registers per thread (two programs per multiprocessor) to 80, and
both kernels from 64 scalar loads per thread to 8 vector loads, the edge calls included
(docs/kernels.md). On an H100 its whole step is faster than the rows layout's at every
measured shape (docs/kernels.md), so ``gpu_layout="auto"`` (the default) takes it wherever it
fits.

Flat offsets are int32, so ``N V`` must stay below ``2^31`` (checked).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from grpo_kernels.compat import out_struct
from grpo_kernels.ops.core.online_softmax import (GRAD_FLOOR, cap_logits, finish, merge_stats,
                                                  reduce_stats, softmax_grad, with_cap_grad)

Array = jax.Array
_F32 = jnp.float32
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_FLOOR = -3.0e38
_INT32_LIMIT = 2 ** 31


def alignment(dtype) -> int:
    """Elements per 16 bytes: the vector width every tile starts on."""
    return max(1, 16 // jnp.dtype(dtype).itemsize)


def full_tiles(vocab: int, block_vocab: int, align: int) -> int:
    """Full tiles per row: as many as fit after the longest head (``align - 1`` elements)."""
    return max(vocab - (align - 1), 0) // block_vocab


def fits(n: int, vocab: int) -> bool:
    """Whether ``[N, V]`` logits can be addressed with this layout's int32 offsets."""
    return n * vocab < _INT32_LIMIT


def _check_size(n: int, vocab: int, who: str, instead: str) -> None:
    if not fits(n, vocab):
        raise ValueError(f"{who} addresses the logits with int32 offsets: "
                         f"N * V = {n} * {vocab} = {n * vocab} must be < 2^31; use "
                         f"{instead} or fewer rows per call")


def row_start(vocab: int, align: int, row=None):
    """``(base, head)`` of row ``row`` (default: this program's, ``program_id(0)``): its first
    element and its head length."""
    base = (pl.program_id(0) if row is None else row) * vocab
    return base, jnp.bitwise_and(-base, align - 1)


def _tile_start(base, head, block_vocab: int, align: int):
    return pl.multiple_of(base + head + pl.program_id(1) * block_vocab, align)


def stats_base2(t: Array):
    """``(m, S, Q)`` of a block of ``t = s log2 e`` (natural-base ``m`` and ``Q``; any shift is
    valid, see :func:`~grpo_kernels.ops.core.online_softmax.block_stats`)."""
    m = jnp.max(t)
    d = t - jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp2(d)
    # The floor keeps 0 * -inf out of Q for -inf logits; it sits off e's path, so a NaN logit
    # still reaches S (Triton's max, like PTX's, returns the operand that is not NaN).
    return m * _LN2, jnp.sum(e), jnp.sum(e * jnp.maximum(d, _FLOOR)) * _LN2


def _stats_tile_kernel(x_ref, m_ref, s_ref, q_ref, *, block_vocab, scale, cap, vocab, align):
    base, head = row_start(vocab, align)
    start = _tile_start(base, head, block_vocab, align)
    t = cap_logits(plgpu.load(x_ref.at[pl.ds(start, block_vocab)]), cap) * scale
    m_ref[...], s_ref[...], q_ref[...] = stats_base2(t)


def edge_segments(x_ref, vocab: int, align: int, full: int, block_vocab: int, width: int,
                  other, row=None):
    """The row's elements outside its full tiles as ``(start, values, columns, mask)``
    segments: the head (``align`` elements from the row's start, valid below ``min(head, V)``),
    the tail's whole vectors (``width`` elements from the end of the full tiles) and the
    tail's last partial vector (``align`` elements). The middle segment's mask changes only
    at vector boundaries, so Triton loads and stores it in 16-byte vectors. Masked entries
    read ``other``; columns count from the row's start. ``row`` as :func:`row_start`'s."""
    base, head = row_start(vocab, align, row)
    first = head + full * block_vocab
    tail = vocab - first
    # A product with align, which Triton's alignment analysis knows is a multiple of it
    # (lax.div: tail >= 0, so truncation is floor without //'s sign fix-ups).
    body = jax.lax.div(tail, align) * align
    segments = []
    for start, size, count, offset in (
            (base, align, jnp.minimum(head, vocab), 0),
            (pl.multiple_of(base + first, align), width, body, first),
            (pl.multiple_of(base + first + body, align), align, tail - body, first + body)):
        idx = jnp.arange(size, dtype=jnp.int32)
        mask = idx < count
        x = plgpu.load(x_ref.at[pl.ds(start, size)], mask=mask, other=other)
        segments.append((start, x, offset + idx, mask))
    return segments


def edge_stats(x_ref, vocab: int, align: int, full: int, block_vocab: int, width: int,
               scale: float, row=None, cap: float | None = None):
    """``(m, S, Q)`` of the row's elements outside its full tiles (:func:`edge_segments`;
    ``scale`` is ``log2(e) / tau``, as for the tiles; the logits soft-capped by ``cap``)."""
    segments = edge_segments(x_ref, vocab, align, full, block_vocab, width, -jnp.inf, row)
    return functools.reduce(merge_stats, [stats_base2(cap_logits(x, cap, mask) * scale)
                                          for _, x, _, mask in segments])


def store_edge_grad(x_ref, o_ref, vocab: int, align: int, full: int, block_vocab: int,
                    width: int, inv_tau: float, y, lse, coef, hcoef, ent, row=None,
                    cap: float | None = None) -> None:
    """Writes :func:`softmax_grad` of the row's elements outside its full tiles, chosen
    column included when it lies there, into ``o_ref`` (masked stores; w.r.t. the uncapped
    logits with a ``cap``)."""
    for start, x, cols, mask in edge_segments(x_ref, vocab, align, full, block_vocab, width,
                                              0.0, row):
        capped = cap_logits(x, cap)
        d = softmax_grad(capped * inv_tau - lse, cols == y, coef, hcoef, ent)
        d = with_cap_grad(d, capped, cap).astype(o_ref.dtype)
        plgpu.store(o_ref.at[pl.ds(start, x.shape[0])], d, mask=mask)


def not_chosen_grad(p, t, a, hc2):
    """A full tile's gradient in base 2, the not-chosen case of :func:`softmax_grad`:
    ``-p (c + c_h (u + H)) = -p (a + hc2 t)`` with ``t = u log2 e``, ``p = 2^t``,
    ``a = c + c_h H`` and ``hc2 = c_h ln 2`` (``None``: no entropy term). ``t`` is floored at
    ``GRAD_FLOOR`` so that a ``-inf`` logit gives 0, not ``0 * -inf``."""
    return -p * (a if hc2 is None else a + hc2 * jnp.maximum(t, GRAD_FLOOR))


def _stats_edge_kernel(x_ref, m_ref, s_ref, q_ref, *, block_vocab, scale, cap, vocab, align,
                       full, width):
    m_ref[...], s_ref[...], q_ref[...] = edge_stats(x_ref, vocab, align, full, block_vocab,
                                                    width, scale, cap=cap)


def _grad_tile_kernel(x_ref, lse_ref, a_ref, *rest, block_vocab, scale, cap, vocab, align,
                      with_entropy):
    # rest: the entropy term's factor (with_entropy), with alias_logits the chosen logits (an
    # input only so that XLA gathers them before this call overwrites the logits), the output.
    o_ref = rest[-1]
    base, head = row_start(vocab, align)
    start = _tile_start(base, head, block_vocab, align)
    capped = cap_logits(plgpu.load(x_ref.at[pl.ds(start, block_vocab)]), cap)
    t = capped * scale - lse_ref[...]  # u log2 e, u = s - lse
    p = jnp.exp2(t)  # traced before the row factors are read (see pallas_gpu._grad_kernel)
    d = not_chosen_grad(p, t, a_ref[...], rest[0][...] if with_entropy else None)
    d = with_cap_grad(d, capped, cap)
    plgpu.store(o_ref.at[pl.ds(start, block_vocab)], d.astype(o_ref.dtype))


def _grad_edge_kernel(x_ref, id_ref, lse_ref, coef_ref, zy_ref, *rest, block_vocab, inv_tau,
                      cap, vocab, align, full, width, with_entropy):
    # rest: hcoef and entropy (with_entropy), an aliased destination when there is one, and
    # the output last.
    o_ref = rest[-1]
    hcoef, ent = (rest[0][...], rest[1][...]) if with_entropy else (None, None)
    lse, coef, y = lse_ref[...], coef_ref[...], id_ref[...]
    store_edge_grad(x_ref, o_ref, vocab, align, full, block_vocab, width, inv_tau, y, lse, coef,
                    hcoef, ent, cap=cap)
    # The chosen column when a full tile holds it (the tile wrote the not-chosen value there).
    base, head = row_start(vocab, align)
    in_tiles = (y >= head) & (y < head + full * block_vocab)
    capped_y = cap_logits(zy_ref[...], cap)
    d_y = softmax_grad(capped_y * inv_tau - lse, True, coef, hcoef, ent)
    d_y = with_cap_grad(d_y, capped_y, cap).astype(o_ref.dtype)
    plgpu.store(o_ref.at[pl.ds(base + jnp.where(in_tiles, y, 0), 1)],
                jnp.full((1,), d_y, o_ref.dtype), mask=jnp.full((1,), in_tiles))


def plan_rows(z: Array, block_vocab: int, who: str = "the 'aligned' GPU layout",
              instead: str = "PallasOptions(gpu_layout='rows')",
              ) -> tuple[int, int, int, int, int]:
    """``(N, V, align, full tiles per row, the edge call's tail width)``, after the size
    check (whose error names ``who`` and what to use ``instead``)."""
    n, vocab = z.shape
    _check_size(n, vocab, who, instead)
    align = alignment(z.dtype)
    full = full_tiles(vocab, block_vocab, align)
    return n, vocab, align, full, pl.next_power_of_2(vocab - full * block_vocab)


def whole_spec(size: int) -> pl.BlockSpec:
    """The flat logits, whole, at every grid step (the kernels address them themselves)."""
    return pl.BlockSpec((size,), lambda *_: (0,))


def chosen_logits(z: Array, ids: Array) -> Array:
    """``z[r, ids[r]]``: ``N`` values gathered in XLA (ids clipped: a sharded caller passes -1
    for a chosen id another shard owns)."""
    ids = jnp.clip(ids.astype(jnp.int32), 0, z.shape[1] - 1)
    return jnp.take_along_axis(z, ids[:, None], axis=1)[:, 0]


def row_statistics(z: Array, ids: Array, temperature: float, blocks, params,
                   interpret: bool = False,
                   softcap: float | None = None) -> tuple[Array, Array, Array]:
    """``(logp, lse, entropy)``, each ``[N]`` float32 (as :func:`.pallas_gpu.row_statistics`)."""
    n, vocab, align, full, width = plan_rows(z, blocks.block_vocab)
    flat, scale = z.reshape(n * vocab), _LOG2E / temperature
    whole = whole_spec(n * vocab)
    common = dict(block_vocab=blocks.block_vocab, scale=scale, cap=softcap, vocab=vocab,
                  align=align)
    parts = []
    if full:
        out = out_struct((n, full), _F32, z)
        tile = pl.BlockSpec((None, None), lambda i, j: (i, j))
        parts.append(pl.pallas_call(
            functools.partial(_stats_tile_kernel, **common), grid=(n, full),
            out_shape=(out,) * 3, in_specs=[whole], out_specs=(tile,) * 3,
            compiler_params=params, interpret=bool(interpret), name="grpo_aligned_statistics",
        )(flat))
    row = pl.BlockSpec((None,), lambda i: (i,))
    edge = pl.pallas_call(
        functools.partial(_stats_edge_kernel, full=full, width=width, **common), grid=(n,),
        out_shape=(out_struct((n,), _F32, z),) * 3, in_specs=[whole], out_specs=(row,) * 3,
        compiler_params=params, interpret=bool(interpret), name="grpo_edge_statistics",
    )(flat)
    parts.append(tuple(x[:, None] for x in edge))
    m, s, q = (jnp.concatenate(xs, axis=1) if len(xs) > 1 else xs[0] for xs in zip(*parts))
    chosen = cap_logits(chosen_logits(z, ids), softcap) * (1.0 / temperature)
    return finish(*reduce_stats(m, s, q), chosen)


def logits_gradient(z: Array, ids: Array, lse: Array, coef: Array, temperature: float,
                    blocks, params, interpret: bool = False, alias_logits: bool = False,
                    hcoef: Array | None = None, entropy: Array | None = None,
                    softcap: float | None = None) -> Array:
    """As :func:`.pallas_gpu.logits_gradient`. The full tiles go first (into the logits' own
    buffer with ``alias_logits``, else a fresh one), then the edge call writes each row's head,
    tail and chosen column into that buffer in place; it reads only the head and tail, which
    the tiles never write."""
    n, vocab, align, full, width = plan_rows(z, blocks.block_vocab)
    flat, whole = z.reshape(n * vocab), whole_spec(n * vocab)
    f32 = lambda x: x.astype(_F32)  # noqa: E731
    lse, coef = f32(lse), f32(coef)
    with_entropy = hcoef is not None
    ent_args = (f32(hcoef), f32(entropy)) if with_entropy else ()
    zy = chosen_logits(z, ids)
    out = flat
    if full:
        a = coef + ent_args[0] * ent_args[1] if with_entropy else coef
        args = (lse * _LOG2E, a) + ((ent_args[0] * _LN2,) if with_entropy else ()) + (
            (zy,) if alias_logits else ())
        row2 = pl.BlockSpec((None,), lambda i, j: (i,))
        out = pl.pallas_call(
            functools.partial(_grad_tile_kernel, block_vocab=blocks.block_vocab,
                              scale=_LOG2E / temperature, cap=softcap, vocab=vocab,
                              align=align, with_entropy=with_entropy),
            grid=(n, full), out_shape=out_struct((n * vocab,), z.dtype, z, *args),
            in_specs=[whole] + [row2] * len(args), out_specs=whole,
            input_output_aliases={0: 0} if alias_logits else {}, compiler_params=params,
            interpret=bool(interpret), name="grpo_aligned_gradient",
        )(flat, *args)
    args = (ids.astype(jnp.int32), lse, coef, zy) + ent_args
    # The edge call writes in place into the tiles' output; it reads the logits' head and tail
    # from that buffer when it is the logits' own (aliased), else from the logits.
    dst = (out,) if full and not alias_logits else ()
    src = out if alias_logits else flat
    alias = {0: 0} if alias_logits else ({1 + len(args): 0} if dst else {})
    row = pl.BlockSpec((None,), lambda i: (i,))
    out = pl.pallas_call(
        functools.partial(_grad_edge_kernel, block_vocab=blocks.block_vocab,
                          inv_tau=1.0 / temperature, cap=softcap, vocab=vocab, align=align,
                          full=full, width=width, with_entropy=with_entropy),
        grid=(n,), out_shape=out_struct((n * vocab,), z.dtype, z, *args),
        in_specs=[whole] + [row] * len(args) + [whole] * len(dst), out_specs=whole,
        input_output_aliases=alias, compiler_params=params, interpret=bool(interpret),
        name="grpo_edge_gradient",
    )(src, *args, *dst)
    return out.reshape(n, vocab)
