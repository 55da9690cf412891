r"""Pallas GPU kernels (Triton lowering) for the logits-level GRPO loss.

Same math as :mod:`grpo_kernels.ops.logits_loss.pallas_tpu`, shaped for a GPU: the ``[N, V]``
logits are cut into vocabulary tiles of ``block_vocab`` columns (a power of two) and every tile
of every row is one Triton program, a 2-D grid ``(N, V // block_vocab)`` with no loop inside a
program:

- statistics: each program writes its tile's ``(m, S, Q)`` and chosen-logit share into
  ``[N, tiles]`` partials, which :func:`~grpo_kernels.ops.core.online_softmax.reduce_stats`
  merges in XLA (``16 N tiles`` bytes, next to ``2 N V`` read);
- gradient: each program writes its tile of ``dz = c (onehot(y) - e^{s - lse})`` (and the
  entropy term of :func:`~grpo_kernels.ops.core.online_softmax.softmax_grad` when the loss has one).

The ragged last ``V mod block_vocab`` columns go through one more call of the same kernel with
grid ``(N,)``, a masked load and a masked store. Only that call masks, so the full tiles load
and store in 16-byte vectors.

Why one program per tile: one program per row sweeping all of ``V`` keeps a 4096-column tile
in registers, which allows about three programs per multiprocessor, too few to keep an H100's
memory system busy. Tiles give ``N V / block_vocab`` independent programs and the scheduler
keeps it busy.

Why Triton and not Mosaic GPU: in jax 0.10-0.11 the Triton lowering covers every NVIDIA GPU JAX
supports (Ampere and newer) with plain ``pl.load``/``pl.store``; this op is a bandwidth-bound
row reduction with no matrix multiply, so it gains nothing from Mosaic GPU's warpgroup and TMA
machinery, which is Hopper-only and needs explicit pipelining. See docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from grpo_kernels.compat import out_struct
from grpo_kernels.ops.logits_loss import pallas_gpu_aligned as aligned
from grpo_kernels.ops.core.online_softmax import (block_stats, cap_logits, finish, reduce_stats,
                                                  softmax_grad, with_cap_grad)
from grpo_kernels.ops.core.truncation import drop_outside

Array = jax.Array
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class GpuBlocks:
    """Tiling of the GPU kernels: vocabulary tile per program (a power of two), warps per
    program, and the layout (``"rows"``: this module's kernels; ``"aligned"``:
    :mod:`~grpo_kernels.ops.logits_loss.pallas_gpu_aligned`)."""

    block_vocab: int
    num_warps: int
    layout: str = "rows"


LAYOUTS = ("rows", "aligned")
# What callers may ask for: a layout, or "auto" (plan_blocks picks by the row count).
LAYOUT_CHOICES = ("auto", *LAYOUTS)


def plan_blocks(vocab: int, block_vocab: int | None = None, layout: str = "rows",
                n: int | None = None) -> GpuBlocks:
    """Power-of-two tile of at most 8192 columns, 4 warps (64 columns per thread).

    The tile an H100 probe of tiles from 1024 to 8192 columns chose (the figures and the probe
    are in docs/benchmarks.md, "How the GPU kernels' layout and tiling were
    chosen"). ``layout="auto"`` is ``"aligned"`` (faster at every shape timed on an H100,
    the same section) where ``N * V < 2^31`` (``n`` rows; its int32 offsets), else ``"rows"``.
    """
    if block_vocab is None:
        block_vocab = min(8192, pl.next_power_of_2(vocab))
    if block_vocab & (block_vocab - 1):
        raise ValueError(f"block_vocab must be a power of two on GPU, got {block_vocab}")
    if layout not in LAYOUT_CHOICES:
        raise ValueError(f"the GPU layout must be 'auto' or one of {LAYOUTS}, got {layout!r}")
    if layout == "auto":
        layout = "aligned" if n is not None and aligned.fits(n, vocab) else "rows"
    return GpuBlocks(block_vocab, num_warps=4, layout=layout)


def _tile(x_ref, start, block_vocab, vocab, ragged, other):
    """The tile ``[start, start + block_vocab)`` of a row as float32, and its column ids."""
    cols = start + jnp.arange(block_vocab, dtype=jnp.int32)
    if ragged:
        x = plgpu.load(x_ref.at[pl.ds(start, block_vocab)], mask=cols < vocab, other=other)
    else:
        x = plgpu.load(x_ref.at[pl.ds(pl.multiple_of(start, block_vocab), block_vocab)])
    return x, cols


def _start(block_vocab: int, ragged: bool, full: int):
    # The ragged tile's start is made a traced value: a static slice past the ref's end is
    # rejected at trace time even when masked.
    return full * block_vocab + 0 * pl.program_id(0) if ragged else (
        pl.program_id(1) * block_vocab)


def _stats_kernel(x_ref, id_ref, m_ref, s_ref, q_ref, c_ref, *, block_vocab, inv_tau, cap,
                  ragged):
    vocab = x_ref.shape[0]
    start = _start(block_vocab, ragged, vocab // block_vocab)
    x, cols = _tile(x_ref, start, block_vocab, vocab, ragged, -jnp.inf)
    x = cap_logits(x, cap, cols < vocab if ragged else None) * inv_tau
    m_ref[...], s_ref[...], q_ref[...] = block_stats(x)
    c_ref[...] = jnp.sum(jnp.where(cols == id_ref[...], x, 0.0))


def _grad_kernel(x_ref, id_ref, lse_ref, coef_ref, *rest, block_vocab, inv_tau, cap, ragged,
                 with_entropy, with_floor):
    # rest: the row's truncation floor (with_floor), the entropy term's per-row factor and
    # entropy (with_entropy), an aliased destination when there is one, and the output last.
    o_ref = rest[-1]
    floor_ref = rest[0] if with_floor else None
    rest = rest[with_floor:]
    hcoef, ent = (rest[0][...], rest[1][...]) if with_entropy else (None, None)
    vocab = x_ref.shape[0]
    start = _start(block_vocab, ragged, vocab // block_vocab)
    x, cols = _tile(x_ref, start, block_vocab, vocab, ragged, 0.0)
    capped = cap_logits(x, cap)
    u = capped * inv_tau - lse_ref[...]
    if with_floor:  # the truncation's dropped entries: p = 0 (before the exp that reads u)
        u = drop_outside(u, capped * inv_tau, floor_ref[...], cols == id_ref[...])
    # The order of these lines is the order of the Triton IR, and it matters: with the two
    # scalar loads traced before the exp, the kernel took 1.45-1.65x as long on an H100 at
    # V = 151,643 (unaligned rows, 2-byte loads), with no change at V = 151,936
    # (docs/kernels.md, "Benchmarks").
    p = jnp.exp(u)
    coef = coef_ref[...]
    hit = cols == id_ref[...]
    d = with_cap_grad(softmax_grad(u, hit, coef, hcoef, ent, p=p), capped, cap)
    d = d.astype(o_ref.dtype)
    if ragged:
        plgpu.store(o_ref.at[pl.ds(start, block_vocab)], d, mask=cols < vocab)
    else:
        plgpu.store(o_ref.at[pl.ds(pl.multiple_of(start, block_vocab), block_vocab)], d)


def _grid(n: int, vocab: int, block_vocab: int, ragged: bool) -> tuple[int, ...]:
    return (n,) if ragged else (n, vocab // block_vocab)


def _specs(vocab: int, ragged: bool):
    """BlockSpecs of a whole row and of a per-row scalar for either grid."""
    if ragged:
        return pl.BlockSpec((None, vocab), lambda i: (i, 0)), pl.BlockSpec((None,), lambda i: (i,))
    return (pl.BlockSpec((None, vocab), lambda i, j: (i, 0)),
            pl.BlockSpec((None,), lambda i, j: (i,)))


def _params(blocks: GpuBlocks):
    # No loop runs inside a program, so Triton's pipelining depth has nothing to act on.
    return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=2)


def row_statistics(z: Array, ids: Array, temperature: float, blocks: GpuBlocks,
                   interpret: bool = False,
                   softcap: float | None = None) -> tuple[Array, Array, Array]:
    """``(logp, lse, entropy)``, each ``[N]`` float32; arguments as the TPU version's."""
    if blocks.layout == "aligned":
        return aligned.row_statistics(z, ids, temperature, blocks, _params(blocks), interpret,
                                      softcap)
    n, vocab = z.shape
    ids = ids.astype(jnp.int32)
    full, tail = divmod(vocab, blocks.block_vocab)
    parts = []
    for ragged in ((False,) if full else ()) + ((True,) if tail else ()):
        row, scalar = _specs(vocab, ragged)
        tile_out = scalar if ragged else pl.BlockSpec((None, None), lambda i, j: (i, j))
        out = out_struct((n,) if ragged else (n, full), _F32, z, ids)
        m, s, q, c = pl.pallas_call(
            functools.partial(_stats_kernel, block_vocab=blocks.block_vocab,
                              inv_tau=1.0 / temperature, cap=softcap, ragged=ragged),
            grid=_grid(n, vocab, blocks.block_vocab, ragged), out_shape=(out,) * 4,
            in_specs=[row, scalar], out_specs=(tile_out,) * 4, compiler_params=_params(blocks),
            interpret=bool(interpret), name="grpo_tile_statistics",
        )(z, ids)
        parts.append((m, s, q, c) if not ragged else tuple(x[:, None] for x in (m, s, q, c)))
    m, s, q, c = (jnp.concatenate(xs, axis=1) if len(xs) > 1 else xs[0] for xs in zip(*parts))
    return finish(*reduce_stats(m, s, q), jnp.sum(c, axis=1))


def logits_gradient(z: Array, ids: Array, lse: Array, coef: Array, temperature: float,
                    blocks: GpuBlocks, interpret: bool = False,
                    alias_logits: bool = False, hcoef: Array | None = None,
                    entropy: Array | None = None, softcap: float | None = None,
                    floor: Array | None = None) -> Array:
    """:func:`softmax_grad` of ``u = c(z) / temperature - lse`` as ``[N, V]`` in ``z.dtype``:
    ``coef (onehot(ids) - exp(u))``, minus ``hcoef exp(u) (u + entropy)`` when ``hcoef`` is
    given, times the soft cap's derivative with a ``softcap``, ``exp(u)`` 0 below each row's
    truncation ``floor`` (arguments as the TPU version's; the ``"aligned"`` layout takes no
    ``floor``).

    The full tiles and the ragged tail are two calls writing one buffer. Without aliasing the
    full tiles go first into a fresh output and the tail call writes into it in place; with
    ``alias_logits`` the tail goes first, into the logits' own buffer, whose full tiles the
    second call then reads and overwrites tile by tile (each program reads its tile before it
    writes it, and no other program touches it).
    """
    if blocks.layout == "aligned":
        if floor is not None:
            raise ValueError("a truncation floor needs the 'rows' GPU layout")
        return aligned.logits_gradient(z, ids, lse, coef, temperature, blocks, _params(blocks),
                                       interpret, alias_logits, hcoef, entropy, softcap)
    n, vocab = z.shape
    with_entropy = hcoef is not None
    args = (ids.astype(jnp.int32), lse.astype(_F32), coef.astype(_F32)) + (
        (floor.astype(_F32),) if floor is not None else ()) + (
        (hcoef.astype(_F32), entropy.astype(_F32)) if with_entropy else ())
    full, tail = divmod(vocab, blocks.block_vocab)

    def call(ragged: bool, src: Array, dst: Array | None, alias: dict[int, int]) -> Array:
        row, scalar = _specs(vocab, ragged)
        extra = () if dst is None else (dst,)
        return pl.pallas_call(
            functools.partial(_grad_kernel, block_vocab=blocks.block_vocab,
                              inv_tau=1.0 / temperature, cap=softcap, ragged=ragged,
                              with_entropy=with_entropy, with_floor=floor is not None),
            grid=_grid(n, vocab, blocks.block_vocab, ragged),
            out_shape=out_struct((n, vocab), z.dtype, z, *args),
            in_specs=[row] + [scalar] * len(args) + [row] * len(extra), out_specs=row,
            input_output_aliases=alias, compiler_params=_params(blocks),
            interpret=bool(interpret), name="grpo_tile_gradient",
        )(src, *args, *extra)

    order = [r for r, present in ((False, full), (True, tail)) if present]
    if alias_logits:
        out = z
        for ragged in reversed(order):  # tail first: it reads columns the tiles never write
            out = call(ragged, out, None, {0: 0})
        return out
    out = call(order[0], z, None, {})
    if len(order) > 1:
        out = call(order[1], z, out, {1 + len(args): 0})
    return out
