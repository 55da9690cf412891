r"""Pallas TPU (Mosaic) kernels for the logits-level GRPO loss.

The logits are ``N = B*T`` rows of ``V``. Two kernels, both on a 1-D grid over blocks of
``block_rows`` rows whose dimension is ``"parallel"`` (batch and time both feed it, and a
megacore chip splits it across its cores):

* :func:`row_statistics`: for each row, with ``s = z / tau``, a vocabulary-tiled online
  logsumexp in float32 that carries, per row, the running max ``m``, ``S = sum e^{s-m}``,
  ``Q = sum e^{s-m}(s-m)`` and the chosen logit ``s_y`` in the same sweep. Tiles are rebased with
  the online-softmax rule when the max grows. Outputs ``logp = s_y - lse``, ``lse = m + log S``
  and the entropy ``H = log S - Q/S``, each ``[N, 1]`` float32.
* :func:`logits_gradient`: ``dz = c (onehot(y) - e^{s - lse})`` per tile, written in the logits
  dtype, where ``c = g * cotangent / tau`` is one float32 per row. It can write into the logits
  buffer (``input_output_aliases``).

With ``softcap`` (Gemma 2's final-logit cap) both read ``s = c tanh(z / c) / tau`` and the
gradient gains the cap's derivative ``1 - tanh^2(z / c)``, both formed from the tile in VMEM.

Layout. A block is ``[block_rows, V]``: whole rows go from HBM to VMEM in one DMA per grid step
(the pipeline prefetches the next block while the current one is swept), and the kernel tiles
the vocabulary *inside* VMEM in ``block_vocab`` columns with a ``fori_loop`` and a static,
narrower last tile. A ragged ``V`` (151,643 for Qwen2.5) is therefore handled in the kernel:
nothing is padded and no read leaves the array. The row block's second-minor size is a multiple
of 8 (float32) or 16 (bfloat16), as TPU tiling wants, or 8 bfloat16 rows where 16 do not fit
the chip's VMEM (v4: :func:`plan_blocks`); per-row inputs and outputs are ``[N, 1]``
columns whose block ``[block_rows, 1]`` spans the full minor dimension, valid for any ``B``.
Rows beyond the last full block (``N mod block_rows``) go through one more call on a small copy
of just those rows, so no block ever reads past the array.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from grpo_kernels.compat import out_struct
from grpo_kernels.ops.core.online_softmax import block_stats, finish, merge_stats, sweep
from grpo_kernels.ops.core.online_softmax import cap_logits, softmax_grad, with_cap_grad
from grpo_kernels.ops.core.tpu import MiB, VMEM_BYTES, scoped_vmem_limit, tpu_generation
from grpo_kernels.ops.core.truncation import drop_outside

Array = jax.Array
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class TpuBlocks:
    """Tiling of the TPU kernels: rows per grid step, vocabulary tile, scoped VMEM limit, and
    how many buffers the pipeline keeps of each ``[rows, V]`` block (2 overlaps the next
    block's DMA with this one's sweep; 1 when two do not fit the chip's VMEM)."""

    block_rows: int
    block_vocab: int
    vmem_limit_bytes: int
    buffers: int = 2


# Of a chip's VMEM, what the backward's [rows, V] blocks (logits in, dlogits out) may take
# (the rest holds the in-kernel float32 tiles and the [rows, 1] columns), what else a kernel
# needs beyond its blocks, and the scoped limit asked for when the chip has room.
_BLOCK_BUDGET = 24 * MiB
_HEADROOM = 4 * MiB
_OTHER = 2 * MiB
_LIMIT = 48 * MiB


def _dividing(rows: int, tile: int, n: int | None) -> int:
    """The largest multiple of ``tile`` in ``[rows / 2, rows]`` that divides ``n``, else
    ``rows``: whole blocks cover the rows, so no leftover block runs as a second kernel and
    the gradient may alias the logits."""
    if n is None or n % rows == 0:
        return rows
    return next((r for r in range(rows - tile, rows // 2 - 1, -tile) if n % r == 0), rows)


def plan_blocks(vocab: int, dtype: Any, generation: str | None = None,
                block_rows: int | None = None, block_vocab: int | None = None,
                n: int | None = None) -> TpuBlocks:
    """Block sizes from the ``(V, dtype, generation)`` heuristic, with overrides.

    ``block_rows``: as many rows as let the backward's four ``[rows, V]`` buffers (logits and
    dlogits, double-buffered) fit ``min(24 MiB, VMEM - 4 MiB)``, rounded down to the dtype's
    sublane tile (8 for 4-byte, 16 for 2-byte types), at most 512. Where not even one tile
    fits (v4's 16 MiB at Qwen's vocabulary), 8 rows; where 8 rows do not fit double-buffered,
    8 rows single-buffered. With the row count ``n`` given, the planned rows drop (by at most
    half) to a multiple of the tile that divides ``n`` where one exists (at V/4 of Qwen's
    vocabulary, 80 bf16 rows leave a tail of 8192; 64 do not). A given ``block_rows`` is
    double-buffered whenever the chip's VMEM holds that (the limit is raised to fit),
    single-buffered when only that fits.
    ``block_vocab``: 2048 columns (a multiple of 128; 16 rows x 2048 float32 is 128 KiB per
    in-kernel temporary), fewer for a small ``V``.

    Raises:
      ValueError: the rows (given or planned) do not fit the generation's VMEM even with one
        buffer each; the message names the sizes and ``impl="xla"``, which has no such limit.
    """
    gen = tpu_generation(generation)
    vmem = VMEM_BYTES[gen]
    budget = min(_BLOCK_BUDGET, vmem - _HEADROOM)
    itemsize = jnp.dtype(dtype).itemsize
    row_bytes = vocab * itemsize
    tile = 8 * max(1, 4 // itemsize)
    buffers = 2
    if block_rows is None:
        rows = budget // (4 * row_bytes)
        block_rows = min(512, rows // tile * tile) or rows // 8 * 8
        if not block_rows:
            block_rows, buffers = 8, 1
        else:
            block_rows = _dividing(block_rows, min(tile, block_rows), n)
    elif 4 * block_rows * row_bytes + _OTHER > vmem:
        buffers = 1
    blocks_bytes = 2 * buffers * block_rows * row_bytes
    if blocks_bytes + _OTHER > vmem:
        raise ValueError(
            f"TPU {gen}: {block_rows} rows of V={vocab} {jnp.dtype(dtype).name} logits need "
            f"{blocks_bytes / MiB:.1f} MiB of VMEM for the logits and dlogits blocks, more "
            f"than the chip's {vmem // MiB} MiB allows; use impl='xla'")
    if block_vocab is None:
        block_vocab = min(2048, -(-vocab // 128) * 128)
    limit = scoped_vmem_limit(gen, max(_LIMIT, blocks_bytes + 8 * MiB))
    return TpuBlocks(block_rows, block_vocab, limit, buffers)


def _vocab_tiles(vocab: int, block_vocab: int, body, carry):
    """:func:`sweep` over the vocabulary with 128-aligned tile starts; the ragged tail has a
    static start and width, so reads stay inside the VMEM block."""
    return sweep(vocab, block_vocab, body, carry,
                 start=lambda j: pl.multiple_of(j * block_vocab, 128))


def _row_stats(x_ref, ids: Array, block_vocab: int, inv_tau: float,
               cap: float | None) -> tuple[Array, ...]:
    """``(logp, lse, entropy)``, each ``[rows, 1]``, of the VMEM block ``x_ref`` in one sweep
    (the logits soft-capped by ``cap``, if any, before the temperature)."""
    rows, vocab = x_ref.shape

    def tile(start, width, carry):
        stats, chosen = carry
        x = cap_logits(x_ref[:, pl.ds(start, width)], cap) * inv_tau
        cols = start + jax.lax.broadcasted_iota(jnp.int32, (rows, width), 1)
        chosen = chosen + jnp.sum(jnp.where(cols == ids, x, 0.0), axis=1, keepdims=True)
        return merge_stats(stats, block_stats(x, keepdims=True)), chosen

    zeros = jnp.zeros((rows, 1), _F32)
    init = ((jnp.full((rows, 1), -jnp.inf, _F32), zeros, zeros), zeros)
    stats, chosen = _vocab_tiles(vocab, block_vocab, tile, init)
    return finish(*stats, chosen)


def _write_grad(x_ref, o_ref, ids: Array, lse: Array, coef: Array, hcoef: Array | None,
                ent: Array | None, block_vocab: int, inv_tau: float, cap: float | None,
                floor: Array | None = None) -> None:
    """Writes :func:`softmax_grad` of the VMEM block ``x_ref`` into ``o_ref``, tile by tile
    (w.r.t. the uncapped logits: times the cap's derivative); with the rows' truncation
    ``floor`` (``[rows, 1]``) the dropped entries have ``p = 0``."""
    rows, vocab = x_ref.shape

    def tile(start, width, carry):
        capped = cap_logits(x_ref[:, pl.ds(start, width)], cap)
        cols = start + jax.lax.broadcasted_iota(jnp.int32, (rows, width), 1)
        s, hit = capped * inv_tau, cols == ids
        u = s - lse if floor is None else drop_outside(s - lse, s, floor, hit)
        d = softmax_grad(u, hit, coef, hcoef, ent)
        o_ref[:, pl.ds(start, width)] = with_cap_grad(d, capped, cap).astype(o_ref.dtype)
        return carry

    _vocab_tiles(vocab, block_vocab, tile, 0)


def _stats_kernel(x_ref, ids_ref, logp_ref, lse_ref, ent_ref, *, block_vocab, inv_tau, cap):
    logp_ref[...], lse_ref[...], ent_ref[...] = _row_stats(x_ref, ids_ref[...], block_vocab,
                                                           inv_tau, cap)


def _grad_kernel(x_ref, ids_ref, lse_ref, coef_ref, *rest, block_vocab, inv_tau, cap,
                 with_floor):
    # rest: the floor (with_floor), the entropy term's factor and entropies (when present),
    # then the output
    o_ref, rest = rest[-1], rest[:-1]
    floor = rest[0][...] if with_floor else None
    rest = rest[with_floor:]
    hcoef, ent = (rest[0][...], rest[1][...]) if rest else (None, None)
    _write_grad(x_ref, o_ref, ids_ref[...], lse_ref[...], coef_ref[...], hcoef, ent,
                block_vocab, inv_tau, cap, floor)


def _one_pass_kernel(x_ref, ids_ref, *refs, block_vocab, inv_tau, cap, names, row_grad):
    # refs: one [rows, 1] column per name, then the outputs logp, entropy, dlogits.
    columns = {k: r[...] for k, r in zip(names, refs)}
    logp_ref, ent_ref, o_ref = refs[len(names):]
    ids = ids_ref[...]
    logp, lse, ent = _row_stats(x_ref, ids, block_vocab, inv_tau, cap)
    rg = row_grad(logp, columns)
    hcoef = None if rg.h is None else rg.h * inv_tau
    _write_grad(x_ref, o_ref, ids, lse, rg.g * inv_tau, hcoef, None if rg.h is None else ent,
                block_vocab, inv_tau, cap)
    logp_ref[...], ent_ref[...] = logp, ent


def _compiler_params(blocks: TpuBlocks):
    return pltpu.CompilerParams(dimension_semantics=("parallel",),
                                vmem_limit_bytes=blocks.vmem_limit_bytes)


def _row_spec(rows: int, width: int, buffers: int = 2):
    if buffers == 2:  # the pipeline's default
        return pl.BlockSpec((rows, width), lambda i: (i, 0))
    return pl.BlockSpec((rows, width), lambda i: (i, 0), pipeline_mode=pl.Buffered(buffers))


def _interpret_arg(interpret: bool | str):
    if interpret == "hlo":
        return True
    return pltpu.InterpretParams(out_of_bounds_reads="raise") if interpret else False


def _over_row_blocks(call: Callable, z: Array, cols: list[Array], block_rows: int,
                     alias: bool = False) -> Any:
    """``call``'s ``[N, ...]`` outputs (any pytree) over all ``N`` rows of ``z``.

    ``call(zz, per_row, rows, grid, out_rows, alias)`` runs a kernel on a grid of ``grid``
    blocks of ``rows`` rows of ``zz`` (and of the ``[N, 1]`` columns ``per_row``) into outputs
    of ``out_rows`` rows. The full blocks write rows ``[0, main)`` of ``[N, ...]`` outputs; the
    leftover rows run as one block over a small copy of just those rows and go in with an
    in-place ``dynamic_update_slice`` (no second ``[N, V]`` buffer), so no block ever reads
    past the array. Aliasing applies only when ``N`` is a multiple of ``block_rows`` (B*T at
    real shapes), where the blocks cover the whole buffer.
    """
    n = z.shape[0]
    main = n // block_rows * block_rows  # rows in full blocks; the rest are leftovers
    rest = n - main
    if not rest:
        return call(z, cols, block_rows, n // block_rows, n, alias)
    tail = call(z[main:], [c[main:] for c in cols], rest, 1, rest, False)
    if not main:
        return tail
    out = call(z, cols, block_rows, main // block_rows, n, False)
    return jax.tree.map(lambda o, t: jax.lax.dynamic_update_slice_in_dim(o, t, main, 0),
                        out, tail)


def row_statistics(z: Array, ids: Array, temperature: float, blocks: TpuBlocks,
                   interpret: bool = False,
                   softcap: float | None = None) -> tuple[Array, Array, Array]:
    """``(logp, lse, entropy)``, each ``[N]`` float32, of ``softmax(c(z) / temperature)``.

    Args:
      z: ``[N, V]`` logits (bfloat16 or float32).
      ids: ``[N]`` int32 ids in ``[0, V)``.
      temperature: Softmax temperature.
      blocks: Tiling (:func:`plan_blocks`).
      interpret: Run in TPU interpret mode on the CPU, raising on any out-of-bounds read.
      softcap: ``c(z) = softcap * tanh(z / softcap)`` (Gemma 2's soft cap) in float32 before
        the temperature; ``None``: ``c(z) = z``.
    """
    n, vocab = z.shape
    ids = ids.astype(jnp.int32).reshape(n, 1)
    kernel = functools.partial(_stats_kernel, block_vocab=blocks.block_vocab,
                               inv_tau=1.0 / temperature, cap=softcap)

    def call(zz, per_row, rows, grid, out_rows, alias):
        del alias  # the statistics never write into the logits
        out = out_struct((out_rows, 1), _F32, zz, *per_row)
        return pl.pallas_call(
            kernel, grid=(grid,), out_shape=(out, out, out),
            in_specs=[_row_spec(rows, vocab, blocks.buffers), _row_spec(rows, 1)],
            out_specs=(_row_spec(rows, 1),) * 3,
            compiler_params=_compiler_params(blocks), interpret=_interpret_arg(interpret),
            name="grpo_row_statistics",
        )(zz, *per_row)

    logp, lse, ent = _over_row_blocks(call, z, [ids], blocks.block_rows)
    return logp[:, 0], lse[:, 0], ent[:, 0]


def logits_gradient(z: Array, ids: Array, lse: Array, coef: Array, temperature: float,
                    blocks: TpuBlocks, interpret: bool = False,
                    alias_logits: bool = False, hcoef: Array | None = None,
                    entropy: Array | None = None, softcap: float | None = None,
                    floor: Array | None = None) -> Array:
    """:func:`softmax_grad` of ``u = c(z) / temperature - lse`` as ``[N, V]`` in ``z.dtype``:
    ``coef (onehot(ids) - exp(u))``, minus ``hcoef exp(u) (u + entropy)`` with ``hcoef``;
    with a ``softcap``, times ``c'(z) = 1 - (c(z) / softcap)^2`` (the gradient w.r.t. ``z``).
    With a sampler's truncation, ``exp(u)`` is 0 below each row's ``floor``.

    Args:
      z: ``[N, V]`` logits.
      ids, lse, coef: ``[N]`` int32 ids, float32 logsumexp, float32 per-row factor.
      hcoef, entropy: ``[N]`` float32 factor of the entropy term and the rows' entropies, or
        ``None`` (no entropy term: the kernel reads neither).
      temperature, blocks, interpret, softcap: as :func:`row_statistics`.
      floor: ``[N]`` float32 floors of the scaled logits under a sampler's truncation
        (:mod:`grpo_kernels.ops.core.truncation`): entries below it, but the chosen one, are
        dropped; ``None``: none.
      alias_logits: Write dlogits into the logits' buffer (``input_output_aliases``) when
        ``N`` is a multiple of ``blocks.block_rows``; XLA only avoids a copy when the logits
        are otherwise dead (e.g. donated).
    """
    n, vocab = z.shape
    cols = [ids.astype(jnp.int32).reshape(n, 1), lse.astype(_F32).reshape(n, 1),
            coef.astype(_F32).reshape(n, 1)]
    if floor is not None:
        cols.append(floor.astype(_F32).reshape(n, 1))
    if hcoef is not None:
        cols += [hcoef.astype(_F32).reshape(n, 1), entropy.astype(_F32).reshape(n, 1)]
    kernel = functools.partial(_grad_kernel, block_vocab=blocks.block_vocab,
                               inv_tau=1.0 / temperature, cap=softcap,
                               with_floor=floor is not None)

    def call(zz, per_row, rows, grid, out_rows, alias):
        n_cols = len(per_row)
        return pl.pallas_call(
            kernel, grid=(grid,), out_shape=out_struct((out_rows, vocab), z.dtype, zz, *per_row),
            in_specs=[_row_spec(rows, vocab, blocks.buffers)] + [_row_spec(rows, 1)] * n_cols,
            out_specs=_row_spec(rows, vocab, blocks.buffers),
            input_output_aliases={0: 0} if alias else {},
            compiler_params=_compiler_params(blocks), interpret=_interpret_arg(interpret),
            name="grpo_logits_gradient",
        )(zz, *per_row)

    return _over_row_blocks(call, z, cols, blocks.block_rows, alias_logits)


def one_pass(z: Array, ids: Array, columns: dict[str, Array | None], row_grad: Callable,
             temperature: float, blocks: TpuBlocks, interpret: bool = False,
             alias_logits: bool = False,
             softcap: float | None = None) -> tuple[Array, Array, Array]:
    r"""``(logp, entropy, dlogits)`` of a token-separable loss, reading each row block once.

    Each grid step DMAs ``[block_rows, V]`` logits into VMEM once. The kernel sweeps them for
    the row statistics, turns ``logp`` into the tokens' gradient factors with ``row_grad``
    (the objective's own math, on ``[rows, 1]`` columns), and sweeps the same VMEM block again
    to write :math:`\partial L/\partial z` for a unit loss cotangent. A training step then
    moves ``2 V b`` bytes per token (read once, write once) instead of the two-kernel path's
    ``3 V b``.

    Args:
      z: ``[N, V]`` logits.
      ids: ``[N]`` int32 ids in ``[0, V)``.
      columns: ``[N]`` float32 per-token inputs of ``row_grad`` by name (``None``: absent).
      row_grad: ``row_grad(logp, columns) -> RowGrad`` on ``[rows, 1]`` arrays; its ``h``
        (the entropy bonus's factor) may be ``None``.
      temperature, blocks, interpret, softcap: as :func:`row_statistics`.
      alias_logits: as :func:`logits_gradient`.
    """
    n, vocab = z.shape
    names = tuple(k for k, v in columns.items() if v is not None)
    cols = [ids.astype(jnp.int32).reshape(n, 1)] + [
        columns[k].astype(_F32).reshape(n, 1) for k in names]
    kernel = functools.partial(_one_pass_kernel, block_vocab=blocks.block_vocab,
                               inv_tau=1.0 / temperature, cap=softcap, names=names,
                               row_grad=row_grad)

    def call(zz, per_row, rows, grid, out_rows, alias):
        n_cols = len(per_row)
        col = out_struct((out_rows, 1), _F32, zz, *per_row)
        return pl.pallas_call(
            kernel, grid=(grid,),
            out_shape=(col, col, out_struct((out_rows, vocab), z.dtype, zz, *per_row)),
            in_specs=[_row_spec(rows, vocab, blocks.buffers)] + [_row_spec(rows, 1)] * n_cols,
            out_specs=(_row_spec(rows, 1), _row_spec(rows, 1),
                       _row_spec(rows, vocab, blocks.buffers)),
            input_output_aliases={0: 2} if alias else {},
            compiler_params=_compiler_params(blocks), interpret=_interpret_arg(interpret),
            name="grpo_one_pass",
        )(zz, *per_row)

    logp, ent, dz = _over_row_blocks(call, z, cols, blocks.block_rows, alias_logits)
    return logp[:, 0], ent[:, 0], dz
