r"""Pallas GPU kernels (Triton lowering) for the logits-level GRPO loss.

Same two kernels and the same math as :mod:`grpo_kernels.ops.logits_loss.pallas_tpu`, shaped for
a GPU: one program per row (``N = B*T`` programs, so batch and time both give parallelism), the
row swept in power-of-two tiles of ``block_vocab`` columns held in registers, with the ragged
last tile read through a masked load (``other=-inf``) and written through a masked store. The
per-row running max, ``S``, ``Q`` and chosen logit stay in registers across the sweep.

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
from grpo_kernels.ops.logits_loss.online_softmax import block_stats, finish, merge_stats

Array = jax.Array
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class GpuBlocks:
    """Tiling of the GPU kernels: vocabulary tile (a power of two) and warps per program."""

    block_vocab: int
    num_warps: int


def plan_blocks(vocab: int, block_vocab: int | None = None) -> GpuBlocks:
    """Power-of-two tile of at most 4096 columns (16 KiB of float32 per row in registers)."""
    if block_vocab is None:
        block_vocab = min(4096, pl.next_power_of_2(vocab))
    if block_vocab & (block_vocab - 1):
        raise ValueError(f"block_vocab must be a power of two on GPU, got {block_vocab}")
    return GpuBlocks(block_vocab, num_warps=8 if block_vocab >= 2048 else 4)


def _sweep(vocab: int, block_vocab: int, body, carry):
    """Full tiles in a loop, then the masked ragged tail (static start)."""
    full, tail = divmod(vocab, block_vocab)
    if full:
        carry = jax.lax.fori_loop(0, full, lambda j, c: body(j * block_vocab, False, c), carry)
    if tail:
        # The tail tile runs past V and is masked. Its start is made a traced value, since a
        # static slice past the ref's end is rejected at trace time even when masked.
        carry = body(full * block_vocab + 0 * pl.program_id(0), True, carry)
    return carry


def _stats_kernel(x_ref, id_ref, logp_ref, lse_ref, ent_ref, *, block_vocab, inv_tau):
    vocab = x_ref.shape[0]
    y = id_ref[...]
    offs = jnp.arange(block_vocab, dtype=jnp.int32)

    def tile(start, ragged, carry):
        stats, chosen = carry
        cols = start + offs
        if ragged:
            x = plgpu.load(x_ref.at[pl.ds(start, block_vocab)], mask=cols < vocab,
                           other=-jnp.inf)
        else:
            x = plgpu.load(x_ref.at[pl.ds(start, block_vocab)])
        x = x.astype(_F32) * inv_tau
        chosen = chosen + jnp.sum(jnp.where(cols == y, x, 0.0))
        return merge_stats(stats, block_stats(x)), chosen

    zero = jnp.zeros((), _F32)
    stats, chosen = _sweep(vocab, block_vocab, tile,
                           ((jnp.full((), -jnp.inf, _F32), zero, zero), zero))
    logp_ref[...], lse_ref[...], ent_ref[...] = finish(*stats, chosen)


def _grad_kernel(x_ref, id_ref, lse_ref, coef_ref, o_ref, *, block_vocab, inv_tau):
    vocab = x_ref.shape[0]
    y, lse, coef = id_ref[...], lse_ref[...], coef_ref[...]
    offs = jnp.arange(block_vocab, dtype=jnp.int32)

    def tile(start, ragged, carry):
        cols = start + offs
        mask = cols < vocab if ragged else None
        x = plgpu.load(x_ref.at[pl.ds(start, block_vocab)], mask=mask,
                       other=0.0 if ragged else None)
        p = jnp.exp(x.astype(_F32) * inv_tau - lse)
        d = (coef * jnp.where(cols == y, 1.0 - p, -p)).astype(o_ref.dtype)
        plgpu.store(o_ref.at[pl.ds(start, block_vocab)], d, mask=mask)
        return carry

    _sweep(vocab, block_vocab, tile, 0)


def _row(vocab: int):
    return pl.BlockSpec((None, vocab), lambda i: (i, 0))


_SCALAR = pl.BlockSpec((None,), lambda i: (i,))


def row_statistics(z: Array, ids: Array, temperature: float, blocks: GpuBlocks,
                   interpret: bool = False) -> tuple[Array, Array, Array]:
    """``(logp, lse, entropy)``, each ``[N]`` float32; arguments as the TPU version's."""
    n, vocab = z.shape
    out = out_struct((n,), _F32, z, ids)
    return pl.pallas_call(
        functools.partial(_stats_kernel, block_vocab=blocks.block_vocab,
                          inv_tau=1.0 / temperature),
        grid=(n,), out_shape=(out, out, out),
        in_specs=[_row(vocab), _SCALAR], out_specs=(_SCALAR,) * 3,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=2),
        interpret=bool(interpret), name="grpo_row_statistics",
    )(z, ids.astype(jnp.int32))


def logits_gradient(z: Array, ids: Array, lse: Array, coef: Array, temperature: float,
                    blocks: GpuBlocks, interpret: bool = False,
                    alias_logits: bool = False) -> Array:
    """``coef (onehot(ids) - exp(z / temperature - lse))`` as ``[N, V]`` in ``z.dtype``."""
    n, vocab = z.shape
    return pl.pallas_call(
        functools.partial(_grad_kernel, block_vocab=blocks.block_vocab,
                          inv_tau=1.0 / temperature),
        grid=(n,), out_shape=out_struct((n, vocab), z.dtype, z, ids, lse, coef),
        in_specs=[_row(vocab), _SCALAR, _SCALAR, _SCALAR], out_specs=_row(vocab),
        input_output_aliases={0: 0} if alias_logits else {},
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=2),
        interpret=bool(interpret), name="grpo_logits_gradient",
    )(z, ids.astype(jnp.int32), lse.astype(_F32), coef.astype(_F32))
