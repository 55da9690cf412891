r"""Pallas TPU (Mosaic) kernels for the fused LM-head GRPO loss.

Rows are the ``N = B*T`` hidden states ``h [N, H]``; the head is ``W [H, V]`` (``"hv"``) or
``[V, H]`` (``"vh"``), with an optional bias. Three kernels, none of which writes an ``[N, V]``
array:

* :func:`head_statistics`, grid ``(N/tm, V/tv, H/tk)`` with semantics
  ``("parallel", "arbitrary", "arbitrary")``: the logits tile ``z = h W`` is accumulated over
  ``H`` in a VMEM float32 scratch; at the last ``H`` step it is cast to the logits dtype, scaled
  by ``1/tau`` and folded into the running online-softmax triple ``(m, S, Q)`` of each row
  (:mod:`grpo_kernels.ops.core.online_softmax`), together with the chosen logit. The last
  vocabulary step writes ``logp``, ``lse`` and the entropy, ``[N, 1]`` float32 each.
* :func:`head_gradients`: with ``c = g * cotangent / tau`` per row and
  ``delta = c (onehot(y) - e^{s - lse})`` recomputed per tile from ``h``, ``W`` and ``lse``:

  - ``dh`` on grid ``(N/tm "parallel", V/tv "arbitrary")``: ``dh += delta W^T`` in a
    ``[tm, H]`` float32 scratch, written once in the hidden dtype;
  - ``dW`` (and ``db``) on grid ``(V/tv "parallel", N/tm "arbitrary")``:
    ``dW_tile += h^T delta`` in an ``[H, tv]`` float32 scratch, written once in the weight dtype.

  The backward thus recomputes the logits twice: five matmuls of the logits' size in all, the
  price of keeping every accumulator in VMEM without atomics (docs/lm_head.md).

With a soft cap (Gemma 2's final-logit cap, ``HeadFormat.softcap``) every tile's logits
become ``c tanh(z / c)`` after the cast and before ``1/tau``, and ``delta`` gains the cap's
derivative ``1 - tanh^2(z / c)`` (w.r.t. the uncapped logits), formed in the same tile.

Ragged shapes: rows are padded to a multiple of ``tm`` (a copy of ``h``, ``O(N H)``); the
vocabulary is not padded: the last vocabulary tile overhangs ``V`` and its columns ``>= V`` are
masked in-kernel (logits to ``-inf``, gradient and weight columns to 0), so no copy of ``W`` is
made. In interpret mode the overhanging reads return NaN, which the tests rely on to show the
masking is complete.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from grpo_kernels.compat import out_struct
from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective.batch import TokenBatch
from grpo_kernels.ops.core.dtypes import common_dtype
from grpo_kernels.ops.core.online_softmax import (block_stats, cap_logits, finish, merge_stats,
                                                  softmax_grad, with_cap_grad)
from grpo_kernels.ops.core.tpu import row_major_by_default
from grpo_kernels.ops.core.truncation import Truncation, config_truncation, drop_outside
from grpo_kernels.ops.core.vjp import loss_from_pieces
from grpo_kernels.ops.lm_head_loss import xla as head_xla
from grpo_kernels.ops.lm_head_loss.head import HeadFormat, delta_dtype
from grpo_kernels.ops.lm_head_loss.head import matmul as _dot
from grpo_kernels.ops.lm_head_loss.pallas_options import LmHeadPallasOptions, Tiles, plan_tiles

Array = jax.Array
_F32 = jnp.float32


def _params(tiles: Tiles, semantics: tuple[str, ...]) -> Any:
    return pltpu.CompilerParams(dimension_semantics=semantics,
                                vmem_limit_bytes=tiles.vmem_limit_bytes)


def _interpret(interpret: bool | str) -> Any:
    # Reads past the array (the overhanging last vocabulary tile) return NaN instead of
    # raising: the kernels must mask them, and NaN makes any leak visible.
    if not interpret:
        return False
    if interpret == "hlo":  # JAX's generic interpreter (see LmHeadPallasOptions.interpret)
        return True
    return pltpu.InterpretParams(out_of_bounds_reads="uninitialized", uninitialized_memory="nan")


def _matmul_hw(h: Array, w: Array, layout: str) -> Array:
    """``h [m, k] @ W`` for a W tile ``[k, n]`` (hv) or ``[n, k]`` (vh), float32."""
    return _dot(h, w, ((1,), (0,)) if layout == "hv" else ((1,), (1,)))


def _finish_logits(z, b_ref, col0, *, vocab, logits_dtype, tau, cap):
    """``s = c(cast(z + b)) / tau`` of one ``[tm, tv]`` float32 product tile starting at column
    ``col0`` (``c``: the soft cap, if any); with the tile's column indices and the mask of the
    columns inside ``V``."""
    if b_ref is not None:
        z = z + b_ref[...].astype(_F32)
    s = cap_logits(z.astype(logits_dtype), cap) / tau
    cols = col0 + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    return s, cols, cols < vocab


def _stats_kernel(*refs, vocab, tv, nk, layout, logits_dtype, tau, cap, has_bias):
    h_ref, w_ref = refs[:2]
    b_ref = refs[2] if has_bias else None
    ids_ref, logp_ref, lse_ref, ent_ref, acc, m_sc, s_sc, q_sc, c_sc = refs[2 + has_bias:]
    j, k = pl.program_id(1), pl.program_id(2)
    nv = pl.num_programs(1)

    @pl.when((j == 0) & (k == 0))
    def _():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, _F32)
        s_sc[...] = jnp.zeros(s_sc.shape, _F32)
        q_sc[...] = jnp.zeros(q_sc.shape, _F32)
        c_sc[...] = jnp.zeros(c_sc.shape, _F32)

    @pl.when(k == 0)
    def _():
        acc[...] = jnp.zeros(acc.shape, _F32)

    acc[...] += _matmul_hw(h_ref[...], w_ref[...], layout)

    @pl.when(k == nk - 1)
    def _():
        s, cols, valid = _finish_logits(acc[...], b_ref, j * tv, vocab=vocab,
                                        logits_dtype=logits_dtype, tau=tau, cap=cap)
        s = jnp.where(valid, s, -jnp.inf)
        c_sc[...] += jnp.sum(jnp.where(cols == ids_ref[...], s, 0.0), axis=1, keepdims=True)
        m, tot, q = merge_stats((m_sc[...], s_sc[...], q_sc[...]),
                                block_stats(s, keepdims=True))
        m_sc[...], s_sc[...], q_sc[...] = m, tot, q

        @pl.when(j == nv - 1)
        def _():
            logp, lse, ent = finish(m_sc[...], s_sc[...], q_sc[...], c_sc[...])
            logp_ref[...], lse_ref[...], ent_ref[...] = logp, lse, ent


def _w_spec(tiles: Tiles, hidden: int, layout: str, index) -> pl.BlockSpec:
    """BlockSpec of a W tile with ``hidden`` rows of H; ``index(...) -> (k_block, v_block)``."""
    if layout == "hv":
        return pl.BlockSpec((hidden, tiles.vocab), lambda *g: index(*g))
    return pl.BlockSpec((tiles.vocab, hidden), lambda *g: index(*g)[::-1])


def head_statistics(h: Array, w: Array, bias: Array | None, ids: Array, *, layout: str,
                    logits_dtype: Any, temperature: float, tiles: Tiles,
                    interpret: bool = False,
                    softcap: float | None = None) -> tuple[Array, Array, Array]:
    """``(logp, lse, entropy)``, ``[N]`` float32 each, for ``h [N, H]`` (``N`` a multiple of tm),
    the logits soft-capped by ``softcap`` (if any) before the temperature."""
    n, hidden = h.shape
    vocab = w.shape[1] if layout == "hv" else w.shape[0]
    tm, tv, tk = tiles.rows, tiles.vocab, tiles.hidden
    nk = hidden // tk
    grid = (n // tm, pl.cdiv(vocab, tv), nk)
    row = pl.BlockSpec((tm, 1), lambda i, j, k: (i, 0))
    in_specs = [pl.BlockSpec((tm, tk), lambda i, j, k: (i, k)),
                _w_spec(tiles, tk, layout, lambda i, j, k: (k, j))]
    args = [h, w]
    if bias is not None:
        in_specs.append(pl.BlockSpec((1, tv), lambda i, j, k: (0, j)))
        args.append(bias.reshape(1, vocab))
    in_specs.append(row)
    args.append(ids.reshape(n, 1))
    kernel = functools.partial(_stats_kernel, vocab=vocab, tv=tv, nk=nk, layout=layout,
                               logits_dtype=logits_dtype, tau=temperature, cap=softcap,
                               has_bias=bias is not None)
    out = out_struct((n, 1), _F32, *args)
    logp, lse, ent = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=[row, row, row],
        out_shape=[out, out, out],
        scratch_shapes=[pltpu.VMEM((tm, tv), _F32)] + [pltpu.VMEM((tm, 1), _F32)] * 4,
        compiler_params=_params(tiles, ("parallel", "arbitrary", "arbitrary")),
        interpret=_interpret(interpret),
        name="grpo_head_statistics",
    )(*args)
    return logp[:, 0], lse[:, 0], ent[:, 0]


def _delta(h, w_ref, b_ref, row_refs, col0, *, vocab, layout, logits_dtype, tau, cap,
           with_floor):
    """``(delta, w)`` of one tile: the logits gradient (0 past V, in :func:`delta_dtype`) and
    the W tile with its columns past V zeroed (they hold garbage: the tile overhangs the
    array). ``row_refs``: ids, lse, coef, the rows' truncation floors (``with_floor``: the
    entries below them, but the chosen one, have ``p = 0``) and, with an entropy term, its
    factor and the entropies (:func:`softmax_grad`)."""
    ids_ref, lse_ref, coef_ref = row_refs[:3]
    floor = row_refs[3][...] if with_floor else None
    rest = row_refs[3 + with_floor:]
    hcoef, ent = (rest[0][...], rest[1][...]) if rest else (None, None)
    s, cols, valid = _finish_logits(_matmul_hw(h, w_ref[...], layout), b_ref, col0, vocab=vocab,
                                    logits_dtype=logits_dtype, tau=tau, cap=cap)
    hit = cols == ids_ref[...]
    u = s - lse_ref[...]
    if with_floor:
        u = drop_outside(u, s, floor, hit)
    delta = softmax_grad(u, hit, coef_ref[...], hcoef, ent)
    delta = with_cap_grad(delta, s * tau, cap)  # w.r.t. the uncapped logits
    delta = jnp.where(valid, delta, 0.0).astype(delta_dtype(logits_dtype, w_ref.dtype))
    w = w_ref[...]
    wcols = col0 + jax.lax.broadcasted_iota(jnp.int32, w.shape, 1 if layout == "hv" else 0)
    w = jnp.where(wcols < vocab, w, jnp.zeros_like(w))
    return delta, w


def _dh_kernel(*refs, vocab, tv, layout, logits_dtype, tau, cap, has_bias, n_rows, with_floor):
    h_ref, w_ref = refs[:2]
    b_ref = refs[2] if has_bias else None
    row_refs = refs[2 + has_bias:2 + has_bias + n_rows]
    dh_ref, acc = refs[2 + has_bias + n_rows:]
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        acc[...] = jnp.zeros(acc.shape, _F32)

    h = h_ref[...]
    delta, w = _delta(h, w_ref, b_ref, row_refs, j * tv, vocab=vocab,
                      layout=layout, logits_dtype=logits_dtype, tau=tau, cap=cap,
                      with_floor=with_floor)
    acc[...] += _dot(delta, w, ((1,), (1,)) if layout == "hv" else ((1,), (0,)))

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        dh_ref[...] = acc[...].astype(dh_ref.dtype)


def _dw_kernel(*refs, vocab, tv, layout, logits_dtype, tau, cap, has_bias, n_rows, with_floor):
    h_ref, w_ref = refs[:2]
    b_ref = refs[2] if has_bias else None
    rest = refs[2 + has_bias:]
    row_refs, dw_ref = rest[:n_rows], rest[n_rows]
    db_ref = rest[n_rows + 1] if has_bias else None
    acc, bacc = rest[-2:]
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _():
        acc[...] = jnp.zeros(acc.shape, _F32)
        bacc[...] = jnp.zeros(bacc.shape, _F32)

    h = h_ref[...]
    delta, _ = _delta(h, w_ref, b_ref, row_refs, j * tv, vocab=vocab,
                      layout=layout, logits_dtype=logits_dtype, tau=tau, cap=cap,
                      with_floor=with_floor)
    if layout == "hv":
        acc[...] += _dot(h, delta, ((0,), (0,)))
    else:
        acc[...] += _dot(delta, h, ((0,), (0,)))
    if db_ref is not None:
        bacc[...] += jnp.sum(delta.astype(_F32), axis=0, keepdims=True)

    @pl.when(i == pl.num_programs(1) - 1)
    def _():
        dw_ref[...] = acc[...].astype(dw_ref.dtype)
        if db_ref is not None:
            db_ref[...] = bacc[...].astype(db_ref.dtype)


def head_gradients(h: Array, w: Array, bias: Array | None, ids: Array, lse: Array, coef: Array,
                   *, layout: str, logits_dtype: Any, temperature: float, tiles: Tiles,
                   interpret: bool = False, hcoef: Array | None = None,
                   entropy: Array | None = None, softcap: float | None = None,
                   floor: Array | None = None) -> tuple[Array, Array, Array | None]:
    """``(dh, dW, db)`` for per-row factors ``coef = g * cotangent / tau`` and, with an entropy
    term, ``hcoef = h * cotangent / tau`` and the rows' ``entropy`` (``N`` a multiple of tm);
    ``softcap`` as :func:`head_statistics`; ``floor``: ``[N]`` float32 floors of the scaled
    logits under a sampler's truncation (:mod:`grpo_kernels.ops.core.truncation`), below
    which the softmax has ``p = 0`` (but at the chosen id), or ``None``."""
    n, hidden = h.shape
    vocab = w.shape[1] if layout == "hv" else w.shape[0]
    tm, tv = tiles.rows, tiles.vocab
    nv, nr = pl.cdiv(vocab, tv), n // tm
    has_bias = bias is not None
    per_row = [ids.reshape(n, 1), lse.reshape(n, 1), coef.reshape(n, 1)]
    if floor is not None:
        per_row.append(floor.reshape(n, 1))
    if hcoef is not None:
        per_row += [hcoef.reshape(n, 1), entropy.reshape(n, 1)]
    static = dict(vocab=vocab, tv=tv, layout=layout, logits_dtype=logits_dtype,
                  tau=temperature, cap=softcap, has_bias=has_bias, n_rows=len(per_row),
                  with_floor=floor is not None)
    bias_args = [bias.reshape(1, vocab)] if has_bias else []

    # dh: rows parallel, vocabulary accumulated.
    row = pl.BlockSpec((tm, 1), lambda i, j: (i, 0))
    specs = [pl.BlockSpec((tm, hidden), lambda i, j: (i, 0)),
             _w_spec(tiles, hidden, layout, lambda i, j: (0, j))]
    specs += [pl.BlockSpec((1, tv), lambda i, j: (0, j))] * has_bias + [row] * len(per_row)
    dh = pl.pallas_call(
        functools.partial(_dh_kernel, **static), grid=(nr, nv), in_specs=specs,
        out_specs=pl.BlockSpec((tm, hidden), lambda i, j: (i, 0)),
        out_shape=out_struct((n, hidden), h.dtype, h, w, *bias_args, *per_row),
        scratch_shapes=[pltpu.VMEM((tm, hidden), _F32)],
        compiler_params=_params(tiles, ("parallel", "arbitrary")),
        interpret=_interpret(interpret),
        name="grpo_head_dhidden",
    )(h, w, *bias_args, *per_row)

    # dW, db: vocabulary tiles parallel, rows accumulated.
    row = pl.BlockSpec((tm, 1), lambda j, i: (i, 0))
    specs = [pl.BlockSpec((tm, hidden), lambda j, i: (i, 0)),
             _w_spec(tiles, hidden, layout, lambda j, i: (0, j))]
    specs += [pl.BlockSpec((1, tv), lambda j, i: (0, j))] * has_bias + [row] * len(per_row)
    out_specs = [_w_spec(tiles, hidden, layout, lambda j, i: (0, j))]
    out_shape = [out_struct(w.shape, w.dtype, h, w, *bias_args, *per_row)]
    if has_bias:
        out_specs.append(pl.BlockSpec((1, tv), lambda j, i: (0, j)))
        out_shape.append(out_struct((1, vocab), bias.dtype, h, w, *bias_args, *per_row))
    acc_shape = (hidden, tv) if layout == "hv" else (tv, hidden)
    outs = pl.pallas_call(
        functools.partial(_dw_kernel, **static), grid=(nv, nr), in_specs=specs,
        out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM(acc_shape, _F32), pltpu.VMEM((1, tv), _F32)],
        compiler_params=_params(tiles, ("parallel", "arbitrary")),
        interpret=_interpret(interpret),
        name="grpo_head_dweight",
    )(h, w, *bias_args, *per_row)
    db = outs[1].reshape(vocab) if has_bias else None
    return dh, outs[0], db


def pieces(hidden: Array, w: Array, fmt: HeadFormat, options: LmHeadPallasOptions | None,
           temperature: float, interpret: bool | str | None = None,
           trunc: Truncation | None = None):
    """``(stats, grad)`` on ``[B, T, H]`` hidden states and a head (shard) ``w``:

    ``stats(primals, ids)`` -> ``[B, T]`` ``(logp, lse, entropy)`` of the head's columns;
    ``grad(primals, hit_ids, lse, row)`` -> ``(dhidden, dW, db)`` given the whole row's ``lse``
    and :class:`~grpo_kernels.objective.RowGrad` (carrying the loss cotangent; an id of ``-1``
    hits no column).
    ``interpret`` overrides the options' (the sharding layer passes ``"hlo"`` on CPU).

    With the sampler's truncation ``trunc`` (a whole head): ``stats`` is the XLA head's
    truncated pass (:func:`..xla.pieces`: ``(logp, lse, entropy, floor, outside)``, one
    matmul of the logits' size as the statistics kernel's), and ``grad`` takes
    ``(ids, floor)`` for ``hit_ids``: the gradient kernels mask what each row's floor drops.
    """
    opts = options or LmHeadPallasOptions()
    b, t, hdim = hidden.shape
    n = b * t
    compute = common_dtype(hidden.dtype, w.dtype)
    tiles = plan_tiles(n, hdim, fmt.vocab(w), opts)
    pad = -n % tiles.rows
    # W^T is a bitcast of a W that a TPU keeps in the other orientation (see the options).
    flip = opts.match_tpu_layout and not row_major_by_default(w.shape)
    layout = {"hv": "vh", "vh": "hv"}[fmt.layout] if flip else fmt.layout
    static = dict(layout=layout, logits_dtype=fmt.logits_dtype, temperature=temperature,
                  softcap=fmt.softcap, tiles=tiles,
                  interpret=opts.resolved_interpret() if interpret is None else interpret)
    opts.check_backend(static["interpret"])

    def oriented(w):
        return w.T if flip else w

    def rows(x, fill=0):
        x = x.reshape(n, *x.shape[2:])
        return jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1), constant_values=fill)

    # under a truncation the xla head's statistics pass, which finds each row's floor
    truncated_stats = None if trunc is None else head_xla.pieces(
        hidden, w, fmt, None, temperature, fmt.vocab(w), None, trunc=trunc)[0]

    def stats(primals, ids):
        if truncated_stats is not None:
            return truncated_stats(primals, ids)
        hidden, w, bias = primals
        out = head_statistics(rows(hidden.astype(compute)), oriented(w.astype(compute)), bias,
                              rows(ids), **static)
        return tuple(x[:n].reshape(b, t) for x in out)

    def grad(primals, hit_ids, lse, row):
        hidden, w, bias = primals
        floor = {}
        if trunc is not None:
            hit_ids, f = hit_ids
            floor = dict(floor=rows(f))
        row = row.over(temperature)
        entropy = {} if row.h is None else dict(hcoef=rows(row.h), entropy=rows(row.entropy))
        dh, dw, db = head_gradients(rows(hidden.astype(compute)), oriented(w.astype(compute)),
                                    bias, rows(hit_ids, -1), rows(lse), rows(row.g),
                                    **static, **entropy, **floor)
        return (dh[:n].reshape(hidden.shape).astype(hidden.dtype), oriented(dw).astype(w.dtype),
                db)

    return stats, grad


def pallas_lm_head_loss(hidden: Array, lm_head: Array, bias: Array | None, batch: TokenBatch,
                        config: GRPOLossConfig, fmt: HeadFormat, options: LmHeadPallasOptions
                        | None = None) -> tuple[Array, dict[str, Array]]:
    """The fused loss on the TPU kernels; args and returns as ``grpo_loss_from_hidden`` (under
    the config's sampler truncation, :func:`pieces`' XLA statistics pass first)."""
    trunc = config_truncation(config, fmt.vocab(lm_head))
    stats, grad = pieces(hidden, lm_head, fmt, options, config.temperature, trunc=trunc)
    return loss_from_pieces(stats, grad, batch.clamped_ids(fmt.vocab(lm_head)), config,
                            (hidden, lm_head, bias), batch, truncated=trunc is not None)
