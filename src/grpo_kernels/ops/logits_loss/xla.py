r"""Chunked XLA GRPO loss: dlogits formed in the forward pass, backward only scales them.

The logits ``[B, T, V]`` are viewed as ``N = B*T`` rows. Two sweeps, both in float32 arithmetic:

1. **Statistics**, a loop over chunks of rows (and over blocks of the vocabulary with an online
   logsumexp when one row does not fit the working-set budget). Per row, with ``s = z / tau``:

   .. math::

       m = \max_v s_v,\quad S = \sum_v e^{s_v - m},\quad Q = \sum_v e^{s_v - m}(s_v - m),\quad
       \mathrm{lse} = m + \log S,\quad H = \log S - Q / S,\quad \log\pi(y) = s_y - \mathrm{lse}.

   Only these ``[N]`` vectors leave the loop. On CPU, whole rows are shifted by the max of their
   first ``V/16`` columns instead of ``m`` (``lse`` and ``H`` are shift-invariant); a chunk in
   which that shift could overflow goes through the exact row max instead.
2. **Gradient**, after :mod:`grpo_kernels.objective` has turned the ``[B, T]`` log-probs into the
   loss and :math:`g = \partial L / \partial \log\pi(y)`:

   .. math::

       \frac{\partial L}{\partial z_v} = \frac{g}{\tau}\,(\mathbb{1}[v = y] - e^{s_v - \mathrm{lse}}),

   one elementwise expression that XLA fuses into a single kernel reading the logits once and
   writing dlogits once, in the logits dtype (in place when the logits are donated). On CPU the
   float32 -> bfloat16 rounding is written as integer arithmetic (:func:`to_bfloat16`).

Both happen in the ``custom_vjp`` forward; the backward multiplies by the loss cotangent, which XLA
fuses into the same kernel. No float32 ``[B, T, V]`` array exists at any point.

Why the gradient is not written chunk by chunk inside the loop: XLA's CPU backend has no native
bfloat16 ``dynamic-update-slice``/``dynamic-slice``/``scatter``; it upcasts the *whole* buffer to
float32 around each one (slow, and a float32 copy of the logits: docs/xla.md). The loop
therefore slices a ``uint16`` view of bfloat16 logits and writes only float32 row statistics.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective import RowGrad
from grpo_kernels.objective.batch import TokenBatch
from grpo_kernels.ops.core.dtypes import cast_to
from grpo_kernels.ops.core.online_softmax import block_stats, finish, merge_stats, sweep
from grpo_kernels.ops.core.online_softmax import soft_cap, softmax_grad, with_cap_grad
from grpo_kernels.ops.core.options import check_int
from grpo_kernels.ops.core.platform import by_platform
from grpo_kernels.ops.core.truncation import (Truncation, config_truncation, drop_outside,
                                              listed_stats, outside, outside_count,
                                              support_floor, truncate)
from grpo_kernels.ops.core.vjp import loss_with_gradient

Array = jax.Array

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class XlaBlockSizes:
    """Chunking of the statistics sweep of the XLA implementation.

    Attributes:
      chunk_tokens: Rows (tokens) per chunk; ``None`` derives it from ``chunk_bytes``.
      block_vocab: Vocabulary columns per block; ``None`` means whole rows when a row fits
        ``chunk_bytes`` and blocks of ``chunk_bytes`` otherwise.
      chunk_bytes: Target float32 working set of one chunk; ``None`` picks a backend default.
    """

    chunk_tokens: int | None = None
    block_vocab: int | None = None
    chunk_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("chunk_tokens", "block_vocab", "chunk_bytes"):
            check_int("XlaBlockSizes", name, getattr(self, name))


# Working-set targets per backend. CPU: the fastest measured on the development machine
# (docs/xla.md); an accelerator wants enough rows per step to fill the chip.
DEFAULT_CHUNK_BYTES = {"cpu": 16 << 20, "gpu": 256 << 20, "tpu": 256 << 20}


def plan_blocks(n_rows: int, vocab: int, blocks: XlaBlockSizes, backend: str) -> tuple[int, int]:
    """Returns ``(rows_per_chunk, vocab_block)`` for ``n_rows`` rows of ``vocab`` logits."""
    budget = blocks.chunk_bytes or DEFAULT_CHUNK_BYTES.get(backend, 64 << 20)
    block_v = blocks.block_vocab
    if block_v is None:
        block_v = vocab if 4 * vocab <= budget else max(128, (budget // 4) // 128 * 128)
    block_v = min(block_v, vocab)
    rows = blocks.chunk_tokens or max(1, budget // (4 * block_v))
    return max(1, min(rows, n_rows)), block_v


class _Plan(NamedTuple):
    """How :func:`row_statistics` sweeps on one kind of platform (see :func:`plan_blocks`)."""

    rows: int
    block_v: int
    probe: int  # >= V: the exact row max
    cpu: bool


def _load(z: Array, row: Any, rows: int, col: Any, cols: int, temperature: float,
          cpu: bool, softcap: float | None = None) -> Array:
    """``z[row:row+rows, col:col+cols] / temperature`` in float32, ``z`` viewed as ``[N, V]``
    (soft-capped first with ``softcap``: :func:`~grpo_kernels.ops.core.online_softmax.soft_cap`).

    With ``cpu``, 16-bit floats are sliced through a same-width unsigned-integer view: XLA:CPU
    has no native bfloat16 dynamic-slice and would convert the whole array to float32 (see the
    module docstring). The bitcast is applied to the array and then sliced, so XLA fuses both
    into one read of the slice, provided ``z`` is loop-variant (callers pass it through
    :func:`_loop_carried`). Elsewhere the view would cost a copy of ``z`` (XLA:TPU keeps it as
    a buffer of its own).
    """
    vocab = z.shape[-1]
    if cpu and z.dtype.itemsize == 2:
        bits = jax.lax.bitcast_convert_type(z, jnp.uint16).reshape(-1, vocab)
        block = jax.lax.dynamic_slice(bits, (row, col), (rows, cols))
        block = jax.lax.bitcast_convert_type(block, z.dtype)
    else:
        block = jax.lax.dynamic_slice(z.reshape(-1, vocab), (row, col), (rows, cols))
    return soft_cap(block.astype(_F32), softcap) / temperature


def _loop_carried(z: Array) -> Array:
    """Marks ``z`` as changing every iteration so XLA cannot hoist work on all of it.

    Without this, loop-invariant code motion lifts the bitcast (or a float32 conversion) of the
    entire logits out of the loop, i.e. a full copy before the loop starts.
    """
    return jax.lax.optimization_barrier(z)


def shift_probe_width(vocab: int) -> int:
    """Columns whose max serves as the softmax shift of a whole row (see :func:`row_statistics`)."""
    return min(vocab, max(512, vocab // 16))


def row_statistics(
    z: Array, ids: Array, temperature: float, blocks: XlaBlockSizes | None = None,
    probe_width: int | None = None, softcap: float | None = None,
) -> tuple[Array, Array, Array]:
    """Per-row ``(logp, lse, entropy)`` of ``softmax(z / temperature)``, rows flattened (the
    logits soft-capped first with ``softcap``; the probe's shift stays valid, the cap being
    monotonic).

    The sweep is planned for the platform the program is lowered for
    (:func:`~grpo_kernels.ops.core.platform.by_platform`), not the tracing host's: a TPU
    program traced on a CPU host gets the TPU's chunks and none of the CPU's workarounds.

    Args:
      z: ``[..., V]`` logits with ``N`` rows in all (any float dtype; arithmetic in float32).
      ids: ``[N]`` int32 chosen ids, already in ``[0, V)``.
      temperature: Softmax temperature.
      blocks: The chunking (:func:`plan_blocks`); ``None``: the defaults.
      probe_width: With whole rows, the shift of each row is the max of its first
        ``probe_width`` columns (checked; see below). ``None``: :func:`shift_probe_width` on
        CPU, the exact row max elsewhere; ``>= V``: always the exact row max.
      softcap: The logits soft-capped first (:func:`soft_cap`).

    Returns:
      Three ``[N]`` float32 vectors.
    """
    vocab, n = z.shape[-1], ids.shape[0]

    def plan(kind: str) -> _Plan:
        rows, block_v = plan_blocks(n, vocab, blocks or XlaBlockSizes(), kind)
        # the probe answers an XLA:CPU cost; elsewhere the row max is cheap
        probe = probe_width if probe_width is not None else (
            shift_probe_width(vocab) if kind == "cpu" else vocab)
        return _Plan(rows, block_v, probe, kind == "cpu")

    return by_platform(lambda p, z, ids: _row_statistics(z, ids, temperature, p, softcap),
                       plan, z, ids)


def _row_statistics(z: Array, ids: Array, temperature: float, plan: _Plan,
                    softcap: float | None = None) -> tuple[Array, Array, Array]:
    """:func:`row_statistics` under one platform's ``plan``."""
    vocab, n = z.shape[-1], ids.shape[0]
    rows, block_v, probe, cpu = plan

    def whole_rows(start, size, zz):
        s = _load(zz, start, size, 0, vocab, temperature, cpu, softcap)
        idc = jax.lax.dynamic_slice_in_dim(ids, start, size)
        chosen = jnp.take_along_axis(s, idc[:, None], axis=1)[:, 0]
        if probe >= vocab:
            return (*block_stats(s), chosen)
        # Shift by the max of the first `probe` columns instead of the row max: it saves the
        # row-max pass (about a quarter of the sweep on CPU, docs/xla.md). The shift is a real
        # entry of the row, so S >= 1 (no underflow); overflow shows as a non-finite S or Q. Any
        # row where the shift is not finite, or S or Q is not, sends the whole chunk through the
        # exact row-max path, so the result never depends on the shortcut.
        fast = block_stats(s, jnp.max(s[:, :probe], axis=1))
        ok = jnp.all(jnp.isfinite(fast[0]) & jnp.isfinite(fast[1]) & jnp.isfinite(fast[2]))
        exact = lambda zz: block_stats(_load(zz, start, size, 0, vocab, temperature, cpu, softcap))
        return (*jax.lax.cond(ok, lambda zz: fast, exact, zz), chosen)

    def vocab_blocks(start, size, zz):
        idc = jax.lax.dynamic_slice_in_dim(ids, start, size)[:, None]

        def block(col, width, carry):
            acc, zz = carry
            zz = _loop_carried(zz)
            s = _load(zz, start, size, col, width, temperature, cpu, softcap)
            cols = col + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            chosen = acc[3] + jnp.sum(jnp.where(cols == idc, s, 0.0), axis=1)
            return (*merge_stats(acc[:3], block_stats(s)), chosen), zz

        zeros = jnp.zeros((size,), _F32)
        init = (jnp.full((size,), -jnp.inf, _F32), zeros, zeros, zeros)
        return sweep(vocab, block_v, block, (init, zz), like=(zz, ids))[0]

    def chunk(start, size, carry):
        out, zz = carry
        zz = _loop_carried(zz)
        stats = (whole_rows if block_v >= vocab else vocab_blocks)(start, size, zz)
        out = tuple(jax.lax.dynamic_update_slice_in_dim(o, x, start, 0)
                    for o, x in zip(out, stats, strict=True))
        return out, zz

    init = tuple(jnp.zeros((n,), _F32) for _ in range(4))
    stats, _ = sweep(n, rows, chunk, (init, z), like=(z, ids))
    return finish(*stats)


def truncated_statistics(z: Array, ids: Array, temperature: float, trunc: Truncation,
                         blocks: XlaBlockSizes | None = None,
                         softcap: float | None = None) -> tuple[Array, ...]:
    """Per-row ``(logp, lse, entropy, floor, outside)`` of ``softmax(z / temperature)`` under a
    sampler's truncation ``trunc`` (:mod:`grpo_kernels.ops.core.truncation`), rows flattened
    as :func:`row_statistics`: each row's floor, whether its chosen id lies below it, and the
    statistics of the kept set and the chosen token.

    One pass over chunks of whole rows (the floor needs the whole row), as many rows as the
    plan's float32 chunk holds. Under a top-k the statistics come from each row's ``k + 1``
    largest values (:func:`~grpo_kernels.ops.core.truncation.listed_stats`); otherwise from
    the truncated chunk.
    """
    vocab, n = z.shape[-1], ids.shape[0]
    listed = trunc.top_k is not None and trunc.top_k < vocab

    def planned(p: _Plan, z, ids):
        rows = max(1, min(n, p.rows * p.block_v // vocab))

        def chunk(start, size, carry):
            out, zz = carry
            zz = _loop_carried(zz)
            s = _load(zz, start, size, 0, vocab, temperature, p.cpu, softcap)
            idc = jax.lax.dynamic_slice_in_dim(ids, start, size)
            chosen = jnp.take_along_axis(s, idc[:, None], axis=1)[:, 0]
            if listed:
                f, logp, lse, ent, below = listed_stats(s, chosen, trunc)
            else:
                f = support_floor(s, trunc)
                hit = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1) == idc[:, None]
                logp, lse, ent = finish(*block_stats(truncate(s, f, hit)), chosen)
                below = outside(chosen, f)
            return tuple(jax.lax.dynamic_update_slice_in_dim(o, x, start, 0)
                         for o, x in zip(out, (logp, lse, ent, f, below), strict=True)), zz

        init = (*(jnp.zeros((n,), _F32) for _ in range(4)), jnp.zeros((n,), jnp.bool_))
        return sweep(n, rows, chunk, (init, z), like=(z, ids))[0]

    def plan(kind: str) -> _Plan:
        return _Plan(*plan_blocks(n, vocab, blocks or XlaBlockSizes(), kind), vocab,
                     kind == "cpu")

    return by_platform(planned, plan, z, ids)


def logits_gradient(z: Array, ids: Array, lse: Array, grad: RowGrad,
                    temperature: float, softcap: float | None = None,
                    floor: Array | None = None) -> Array:
    r"""``dL/dz`` in the dtype of ``z [..., V]``: :func:`softmax_grad` of ``u = z / tau - lse``
    with the row factors of ``grad`` over ``tau``; without an entropy term,
    ``(g / tau) (onehot(ids) - exp(u))``. With ``softcap`` ``z`` is capped first and the
    result multiplied by the cap's derivative (:func:`with_cap_grad`). With ``floor`` the
    entries below it (but the chosen one) have ``p = 0``: the truncated softmax's derivative.

    ``ids``, ``lse`` and ``grad``'s arrays have the shape of ``z`` without its last axis. A
    single elementwise expression: XLA fuses it (and any later scaling) into one kernel.
    """
    row = grad.map(lambda x: x[..., None]).over(temperature)
    capped = soft_cap(z.astype(_F32), softcap)
    u = capped / temperature - lse[..., None]
    hit = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1) == ids[..., None]
    if floor is not None:
        u = drop_outside(u, capped / temperature, floor[..., None], hit)
    d = with_cap_grad(softmax_grad(u, hit, row.g, row.h, row.entropy), capped, softcap)
    return cast_to(d, z.dtype)


def _forward(logits, batch: TokenBatch, with_grad: bool, *, config: GRPOLossConfig,
             blocks: XlaBlockSizes | None, softcap: float | None = None
             ) -> tuple[tuple[Array, dict[str, Array]], Array | None]:
    b, t, vocab = logits.shape
    ids = batch.clamped_ids(vocab)
    trunc = config_truncation(config, vocab)
    floor = None
    if trunc is None:
        stats = row_statistics(logits, ids.reshape(-1), config.temperature, blocks,
                               softcap=softcap)
    else:
        *stats, floor, dropped = truncated_statistics(logits, ids.reshape(-1),
                                                      config.temperature, trunc, blocks,
                                                      softcap)
        floor = floor.reshape(b, t)
    logp, lse, entropy = (x.reshape(b, t) for x in stats)
    loss, metrics, grad = batch.loss(logp, entropy, config, with_grad)
    if trunc is not None:
        metrics["outside_truncation"] = outside_count(dropped, batch.mask)
    dlogits = None if grad is None else logits_gradient(logits, ids, lse, grad,
                                                        config.temperature, softcap, floor)
    return (loss, metrics), dlogits


def xla_grpo_loss(logits: Array, batch: TokenBatch, config: GRPOLossConfig,
                  options: XlaBlockSizes | None = None,
                  softcap: float | None = None) -> tuple[Array, dict[str, Array]]:
    """Chunked GRPO loss, differentiable w.r.t. ``logits`` (the batch gets zero cotangents).

    Args, returns: as :func:`grpo_kernels.grpo_loss` (checked there); ``options`` overrides
    the chunking; ``softcap``: its ``logit_softcap``.
    """

    def forward(primals, batch, with_grad):
        out, dlogits = _forward(primals[0], batch, with_grad, config=config, blocks=options,
                                softcap=softcap)
        return out, (dlogits,)

    return loss_with_gradient(forward)((logits,), batch)


def pieces(shape: tuple[int, ...], options: XlaBlockSizes | None, temperature: float,
           softcap: float | None = None, trunc: Truncation | None = None):
    """``(stats, grad)`` on primals ``(z,)``, ``z`` a ``[B, T, V_k]`` block of logits (a
    vocabulary shard):

    ``stats((z,), ids)`` gives the ``[B, T]`` ``(logp, lse, entropy)`` of the block's columns;
    ``grad((z,), hit_ids, lse, grad)`` the block's ``(dz,)`` given the whole row's ``lse`` and
    :class:`~grpo_kernels.objective.RowGrad` (an id of ``-1`` hits no column). See
    :mod:`grpo_kernels.sharding`.

    With the sampler's truncation ``trunc`` (whole rows only): ``stats`` also gives each
    row's floor and whether its id lies below it (:func:`truncated_statistics`), and
    ``grad`` takes ``(ids, floor)`` for ``hit_ids``.
    """
    b, t, _ = shape

    def stats(primals, ids):
        flat = ids.reshape(-1)
        if trunc is None:
            out = row_statistics(primals[0], flat, temperature, options, softcap=softcap)
        else:
            out = truncated_statistics(primals[0], flat, temperature, trunc, options, softcap)
        return tuple(x.reshape(b, t) for x in out)

    def grad(primals, hit_ids, lse, row_grad):
        floor = None
        if trunc is not None:
            hit_ids, floor = hit_ids
        return (logits_gradient(primals[0], hit_ids, lse, row_grad, temperature, softcap,
                                floor),)

    return stats, grad
