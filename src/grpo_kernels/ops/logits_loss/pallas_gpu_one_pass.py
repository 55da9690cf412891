r"""The one-pass GPU kernel (Triton lowering): each row's logits read from HBM once, the second
sweep served from L2.

For token-separable configs (:func:`grpo_kernels.objective.token_separable`), as
:func:`.pallas_tpu.one_pass` on TPU. A row of 151,643 bf16 logits is 296 KiB, more than a
multiprocessor's shared memory (228 KiB on an H100), so no program can hold one on chip the
way a TPU block sits in VMEM. What a GPU can hold is the rows now being worked on, in its L2
(50 MB on an H100). So one program owns whole rows, and for each row:

1. sweeps it for :math:`(m, S, Q)` tile by tile (an online merge between tiles, base 2 inside
   them as in the ``"aligned"`` layout) and finishes ``logp``, ``lse`` and :math:`H`;
2. turns ``logp`` into the token's :math:`g` and :math:`h` with the objective's own code
   (``row_grad``, on the token's scalar columns);
3. sweeps the row again and writes :math:`\partial L/\partial z` for a unit loss cotangent:
   :math:`c(\mathbb{1}[v = y] - p_v) - c_h p_v (u_v + H)`, :math:`c = g/\tau`,
   :math:`c_h = h/\tau`.

The second sweep reads what the first read a few microseconds earlier. It comes from L2 when
the rows in flight fit there: ``programs`` persistent programs (each loops over rows
``pid, pid + programs, ...``) hold ``programs`` rows at a time, 39 MB for 132 programs at
V = 151,643 bf16. With a program per row instead, the scheduler would run as many as fit in
registers (several per multiprocessor, hundreds of rows, several times L2) and the first
rows' lines would be gone before their second sweep. A step then moves ``2 V b`` bytes of HBM
traffic per token, against the two kernels' ``3 V b``, if L2 holds. On an H100 it does not
hold at full rate: the proof's ``layouts`` plan (``grpo_kernels.proof.gpu_layouts``'s ``one_pass``
rows) timed this kernel no faster than the aligned two kernels (docs/kernels.md).

The dlogits stores pass through L2 as well, as much again as the rows being read, and so do
the lines the second sweep has finished with. Left alone, L2 would evict by age, and the
rows still waiting for their second sweep are the oldest lines. So the loads and stores
carry eviction priorities (``OnePassBlocks.l2_hints``, on by default; PTX ``createpolicy``
cache hints): the first sweep's loads ``evict_last``, the second sweep's loads and the
stores ``evict_first``. The proof's one-pass sweep times the kernel without them too.

One program per multiprocessor also means nothing else on it has loads in flight while the
program reduces a tile, so each sweep keeps the next tiles' loads in flight meanwhile
(``stages``, :func:`_sweep`).

Rows are addressed as the ``"aligned"`` layout addresses them
(:mod:`~grpo_kernels.ops.logits_loss.pallas_gpu_aligned`): full tiles on 16-byte boundaries,
the head and tail of each row in masked segments. Unlike that layout's gradient tiles, these
compare column ids with the chosen id, because the chosen column is written by the same
program that writes its tile (a second store to it could race with the tile's).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from grpo_kernels.compat import out_struct
from grpo_kernels.ops.core.options import check_int
from grpo_kernels.ops.core.online_softmax import cap_logits, finish, merge_stats, with_cap_grad
from grpo_kernels.ops.logits_loss import pallas_gpu_aligned as aligned

Array = jax.Array
_F32 = jnp.float32
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# Persistent programs per multiprocessor when the device says how many it has: one keeps the
# rows in flight (132 x 296 KiB on an H100) within L2.
PROGRAMS_PER_CORE = 1
_FALLBACK_PROGRAMS = 132  # an H100 SXM's multiprocessors, when the device does not say
# Load stages (see OnePassBlocks): the planner's count, and the most a tiling may ask for.
DEFAULT_STAGES = 2
MAX_STAGES = 4
STAGES_WHY = " (each load stage holds a tile in registers)"


@dataclasses.dataclass(frozen=True)
class OnePassBlocks:
    """Tiling of the one-pass GPU kernel: vocabulary tile (a power of two), warps per program,
    persistent programs (each loops over every ``programs``-th row) and load stages: the
    tiles each sweep has loading at once (1: load a tile, then work on it; ``s``: the loads of
    the next ``s - 1`` tiles are issued before the work on this one, see :func:`_sweep`);
    ``l2_hints``: the full tiles' L2 eviction priorities (module docstring), or none."""

    block_vocab: int
    num_warps: int
    programs: int
    stages: int = DEFAULT_STAGES
    l2_hints: bool = True

    def __post_init__(self) -> None:
        check_int("OnePassBlocks", "block_vocab", self.block_vocab, power_of_two=True)
        check_int("OnePassBlocks", "num_warps", self.num_warps, power_of_two=True)
        check_int("OnePassBlocks", "programs", self.programs)
        check_int("OnePassBlocks", "stages", self.stages, maximum=MAX_STAGES, why=STAGES_WHY)
        if not isinstance(self.l2_hints, bool):
            raise ValueError(f"OnePassBlocks.l2_hints must be a bool, got {self.l2_hints!r}")


def default_programs(n: int) -> int:
    """``PROGRAMS_PER_CORE`` per multiprocessor of the default device (its ``core_count``;
    132 when it has none, e.g. on CPU), at most ``n``."""
    cores = getattr(jax.devices()[0], "core_count", None) or _FALLBACK_PROGRAMS
    return max(1, min(n, PROGRAMS_PER_CORE * int(cores)))


def plan_blocks(n: int, vocab: int, block_vocab: int | None = None,
                programs: int | None = None, num_warps: int = 16,
                stages: int | None = None) -> OnePassBlocks:
    """16384-column tiles and 16 warps (32 columns, four 16-byte vectors of bf16, per thread
    and tile), :func:`default_programs` programs, two load stages, L2 hints on; each but the
    hints may be given instead.

    Not yet measured. Why this guess: with one program per multiprocessor, the program's loads
    are all the memory traffic a multiprocessor has in flight (Triton does not pipeline the
    loads of these loops itself), so tiles are large, 32 KiB of bf16 against the ~20 KiB per
    multiprocessor an H100 needs in flight to reach its bandwidth, and the next tile's load
    is issued before the work on this one (two stages), so that the work does not leave the
    memory idle. ptxas gives this tiling 128 registers per thread, exactly one 512-thread
    program per multiprocessor (docs/kernels.md).
    """
    if block_vocab is None:
        block_vocab = min(16384, pl.next_power_of_2(vocab))
    return OnePassBlocks(block_vocab, num_warps,
                         default_programs(n) if programs is None else min(programs, n),
                         DEFAULT_STAGES if stages is None else stages)


def _sweep(load: Callable, full: int, stages: int, body: Callable, init):
    """``fori_loop`` over a row's ``full`` tiles, ``body(k, tile, carry) -> carry``, with
    ``stages - 1`` tiles loading ahead of the one being worked on.

    ``load(j)`` loads tile ``j``. The tiles ahead ride in the loop's carry: tile
    ``k + stages - 1``'s load is issued at the top of iteration ``k``, and nothing waits for it
    until the iteration that uses it, so the memory works while this iteration computes. Past
    the last tile the loads repeat the last one, which L1 or L2 still holds: a masked load
    would cost Triton its 16-byte vectors (ptxas then issues one 2-byte load per element).
    """
    if stages == 1 or full == 0:
        return jax.lax.fori_loop(0, full, lambda k, c: body(k, load(k), c), init)

    def step(k, carry):
        c, ahead = carry
        ahead_next = (*ahead[1:], load(jnp.minimum(k + stages - 1, full - 1)))
        return body(k, ahead[0], c), ahead_next

    first = tuple(load(min(j, full - 1)) for j in range(stages - 1))
    return jax.lax.fori_loop(0, full, step, (init, first))[0]


def _kernel(x_ref, id_ref, zy_ref, *refs, vocab, align, full, width, block_vocab, inv_tau,
            cap, n, programs, stages, l2_hints, names, row_grad):
    # refs: one [N] float32 column per name, then the outputs logp, entropy, dlogits.
    col_refs = refs[:len(names)]
    logp_ref, ent_ref, o_ref = refs[len(names):]
    scale = _LOG2E * inv_tau
    pid = pl.program_id(0)
    idx = jnp.arange(block_vocab, dtype=jnp.int32)
    # L2 eviction priorities (OnePassBlocks.l2_hints): the first sweep's lines are kept for
    # the second; the second sweep's loads and the dlogits stores are last uses.
    keep, drop = ("evict_last", "evict_first") if l2_hints else (None, None)

    def one_row(i, _):
        r = pid + i * programs
        base, head = aligned.row_start(vocab, align, r)

        # The hint sits on the row's first full tile, not on each tile's start: the first
        # tile's start would fold to this sum, hint and all, and Triton would load it
        # element by element; tile starts below inherit the alignment from it.
        first = pl.multiple_of(base + head, align)

        def tile(k):
            return pl.ds(first + k * block_vocab, block_vocab)

        def loader(policy):
            return lambda k: plgpu.load(x_ref.at[tile(k)], eviction_policy=policy)

        def stats_tile(k, x, c):
            return merge_stats(c, aligned.stats_base2(cap_logits(x, cap) * scale))

        empty = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.float32(0.0))
        c = merge_stats(_sweep(loader(keep), full, stages, stats_tile, empty),
                        aligned.edge_stats(x_ref, vocab, align, full, block_vocab, width, scale,
                                           r, cap))
        y = id_ref[r]
        logp, lse, ent = finish(*c, cap_logits(zy_ref[r], cap) * inv_tau)
        rg = row_grad(logp, {k: ref[r] for k, ref in zip(names, col_refs)})
        coef = rg.g * inv_tau
        hcoef = None if rg.h is None else rg.h * inv_tau
        # Tiles in base 2: t = u log2 e, p = 2^t, and c_h p u = (c_h ln 2) p t.
        a = coef if hcoef is None else coef + hcoef * ent
        hc2 = None if hcoef is None else hcoef * _LN2
        lse2 = lse * _LOG2E

        def grad_tile(k, x, c):
            # With alias_logits o_ref is x_ref: the tiles loading ahead are the next ones,
            # which this store does not touch.
            capped = cap_logits(x, cap)
            t = capped * scale - lse2
            d = aligned.not_chosen_grad(jnp.exp2(t), t, a, hc2)
            d = d + jnp.where(idx == y - head - k * block_vocab, coef, 0.0)
            d = with_cap_grad(d, capped, cap)
            plgpu.store(o_ref.at[tile(k)], d.astype(o_ref.dtype), eviction_policy=drop)
            return c

        _sweep(loader(drop), full, stages, grad_tile, jnp.int32(0))
        aligned.store_edge_grad(x_ref, o_ref, vocab, align, full, block_vocab, width, inv_tau, y,
                                lse, coef, hcoef, ent, r, cap)
        logp_ref[r], ent_ref[r] = logp, ent

    jax.lax.fori_loop(0, (n - pid + programs - 1) // programs, one_row, None)


def one_pass(z: Array, ids: Array, columns: dict[str, Array | None], row_grad: Callable,
             temperature: float, blocks: OnePassBlocks, interpret: bool = False,
             alias_logits: bool = False,
             softcap: float | None = None) -> tuple[Array, Array, Array]:
    r"""``(logp, entropy, dlogits)`` of a token-separable loss; arguments as
    :func:`.pallas_tpu.one_pass`'s, with ``row_grad`` called on the token's scalars.

    ``N V`` must stay below ``2^31`` (int32 offsets, checked).
    """
    n, vocab, align, full, width = aligned.plan_rows(
        z, blocks.block_vocab, "the one-pass GPU kernel", "PallasOptions(one_pass=False)")
    names = tuple(k for k, v in columns.items() if v is not None)
    cols = [columns[k].astype(_F32).reshape(n) for k in names]
    args = (ids.astype(jnp.int32), aligned.chosen_logits(z, ids), *cols)
    whole = [aligned.whole_spec(n * vocab)] + [aligned.whole_spec(n)] * len(args)
    col = out_struct((n,), _F32, z, *args)
    kernel = functools.partial(
        _kernel, vocab=vocab, align=align, full=full, width=width,
        block_vocab=blocks.block_vocab, inv_tau=1.0 / temperature, cap=softcap, n=n,
        programs=blocks.programs, stages=blocks.stages, l2_hints=blocks.l2_hints, names=names,
        row_grad=row_grad)
    logp, ent, dz = pl.pallas_call(
        kernel, grid=(blocks.programs,),
        out_shape=(col, col, out_struct((n * vocab,), z.dtype, z, *args)),
        in_specs=whole, out_specs=(aligned.whole_spec(n), aligned.whole_spec(n), whole[0]),
        input_output_aliases={0: 2} if alias_logits else {},
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=2),
        interpret=bool(interpret), name="grpo_gpu_one_pass",
    )(z.reshape(n * vocab), *args)
    return logp, ent, dz.reshape(n, vocab)
