r"""Fused LM-head GRPO loss in XLA: token chunks, gradients formed in the forward pass.

The hidden states ``[B, T, H]`` are viewed as ``N = B*T`` rows ``h_n``; the head is
``W [H, V]`` (layout ``"hv"``) or ``[V, H]`` (``"vh"``), with an optional bias ``b [V]``. One
loop over chunks of ``c`` rows does, per chunk, in float32 arithmetic:

.. math::

    z &= \mathrm{cast}_{\text{logits\_dtype}}(h W + b), \qquad s = z / \tau
      \qquad ([c, V],\ \text{the only vocabulary-sized arrays}) \\
    \mathrm{lse}, H, \log\pi(y) &\ \text{from the online-softmax statistics of } s
      \ (\text{:mod:`grpo_kernels.ops.core.online_softmax`}) \\
    g &= \partial L / \partial \log\pi(y)
      \quad(\text{per token: :func:`grpo_kernels.objective.token_loss_grad`}) \\
    \delta &= \frac{g}{\tau}\,(\mathbb{1}[v = y] - e^{s - \mathrm{lse}}) \qquad [c, V] \\
    \partial L/\partial h &= \delta W^\top \ \ (\text{rows of this chunk, written once}), \qquad
    \partial L/\partial W \mathrel{+}= h^\top \delta, \qquad
    \partial L/\partial b \mathrel{+}= \textstyle\sum_n \delta_n

with ``dW`` and ``db`` accumulated in float32 and cast to the weight dtype once, after the loop
(``dW`` in blocks of its rows, :func:`_accumulate_dweight`).
That is three matmuls of the size of the logits, the least a gradient of ``h W`` can cost. The
loop runs in the ``custom_vjp`` forward; the backward only multiplies by the loss cotangent. The
primal alone (no gradient) is one matmul per chunk and the statistics.

Token-level importance sampling makes ``g`` a function of the token's own log-prob, so the
gradient is formed in the same pass (with an entropy bonus, :math:`\delta` gains the term
:math:`h\,\partial H/\partial s`, :math:`h` known from the mask). At sequence level (GSPO),
and with the options that look at other tokens' log-probs (VESPO, the off-policy mask, a
sequence-level sampler correction; :func:`grpo_kernels.objective.token_separable`), ``g``
needs more than the token; the op then runs the loop twice: statistics first (one matmul),
then the gradient pass with ``g`` known (three more). The batch's entropy quantile makes one
pass with an estimated selection and corrects the tokens the exact one changes
(:mod:`.xla_quantile`).

Peak temporary memory is ``O(c V)`` plus the ``[H, V]`` float32 accumulator and ``[N, H]`` for
``dhidden``: no ``[N, V]`` array exists. ``c`` comes from a byte budget over ``V``
(:func:`plan_chunk`). With ``LmHeadBlockSizes(dweight="vocab")`` the token pass forms ``dh``
only, and ``dW``, ``db`` come from a pass over blocks of vocabulary columns
(:func:`~grpo_kernels.ops.lm_head_loss.xla_vocab.vocab_sweep`): no accumulator, one more
matmul of the logits' size.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import numpy as np

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective import (
    RowGrad,
    separable_given_selection,
    token_row_grad,
    token_separable,
)
from grpo_kernels.objective.batch import TokenBatch
from grpo_kernels.ops.core.dtypes import common_dtype
from grpo_kernels.ops.core.platform import by_platform
from grpo_kernels.ops.core.truncation import Truncation, config_truncation, outside_count
from grpo_kernels.ops.core.vjp import loss_with_gradient, scale_by_cotangent
from grpo_kernels.ops.lm_head_loss.head import HeadFormat
from grpo_kernels.ops.lm_head_loss.xla_plan import (LmHeadBlockSizes, dweight_rows,
                                                    plan_chunk, plan_vocab_block)
from grpo_kernels.ops.lm_head_loss.xla_quantile import QuantilePass
from grpo_kernels.ops.lm_head_loss.xla_sweep import GradFn, Head, head_sweep
from grpo_kernels.ops.lm_head_loss.xla_sweep import rows_of as _rows
from grpo_kernels.ops.lm_head_loss.xla_vocab import vocab_stats, vocab_sweep

Array = jax.Array


def _correction_rows(rows: int) -> int:
    """Rows per chunk of :mod:`.xla_quantile`'s correction: a quarter of the sweep's (the
    corrected tokens are a few percent of the batch; a whole chunk for a few of them would
    cost more than they do)."""
    return max(8, rows // 4 // 8 * 8)


class _Plan(NamedTuple):
    """The chunking of one kind of platform (:func:`plan_chunk`, :func:`plan_vocab_block`,
    :func:`dweight_rows`)."""

    rows: int
    cols: int
    dw_rows: int
    cpu: bool


def _planner(n_rows: int, hidden: int, vocab: int, blocks: LmHeadBlockSizes,
             chunk_vocab: int | None = None, parts: int = 1) -> Callable[[str], _Plan]:
    """``plan(kind)`` for :func:`~grpo_kernels.ops.core.platform.by_platform`: chunks of
    ``n_rows`` rows planned as for ``chunk_vocab`` columns (default ``vocab``), a multiple of
    ``parts``; vocabulary blocks and ``dW`` row blocks for ``vocab`` columns (a vocabulary
    shard passes the whole head's)."""
    def plan(kind: str) -> _Plan:
        rows = plan_chunk(n_rows, chunk_vocab or vocab, blocks, kind)
        return _Plan(max(parts, rows // parts * parts),
                     plan_vocab_block(n_rows, vocab, blocks, kind),
                     dweight_rows(hidden, vocab, kind), kind == "cpu")
    return plan


def _rows_and_head(hidden: Array, w: Array, bias: Array | None,
                   fmt: HeadFormat, cpu: bool) -> tuple[Array, Head]:
    """``hidden`` as ``[N, H]`` rows and the :class:`Head`, both in the operands' common dtype
    (a mix: ``W`` upcast once per call); ``cpu``: the head of a program planned for CPU."""
    compute = common_dtype(hidden.dtype, w.dtype)
    head = Head(w.astype(compute), bias, fmt.layout, fmt.logits_dtype, cpu, fmt.softcap)
    return hidden.reshape(-1, hidden.shape[-1]).astype(compute), head


def _token_grad_fn(batch: TokenBatch, config: GRPOLossConfig) -> GradFn:
    """``grad_fn`` of :func:`head_sweep` for a token-separable config: each chunk's
    :class:`RowGrad` from its own log-probs and columns
    (:func:`grpo_kernels.objective.token_row_grad`)."""
    columns = batch.token_columns(config)

    def grad_fn(start, size, logp, _=None):
        return token_row_grad(logp, {k: _rows(v, start, size) for k, v in columns.items()},
                              config)

    return grad_fn


def _given_grad_fn(row: RowGrad) -> GradFn:
    """``grad_fn`` of a pass whose :class:`RowGrad` is already known (``[N]`` arrays)."""
    return lambda start, size, *_: row.map(
        lambda x: jax.lax.dynamic_slice_in_dim(x, start, size))


def _cast_grads(primals: tuple, dh: Array, dw: Array, db: Array | None) -> tuple:
    """``(dhidden, dW, db)`` in the primals' shapes and dtypes."""
    hidden, w, bias = primals
    return (dh.reshape(hidden.shape).astype(hidden.dtype), dw.astype(w.dtype),
            None if db is None else db.astype(bias.dtype))


def xla_lm_head_loss(hidden: Array, lm_head: Array, bias: Array | None, batch: TokenBatch,
                     config: GRPOLossConfig, fmt: HeadFormat,
                     options: LmHeadBlockSizes | None = None) -> tuple[Array, dict[str, Array]]:
    """Fused, chunked GRPO loss from hidden states; differentiable w.r.t. hidden, head, bias.

    Args, returns: as :func:`grpo_kernels.grpo_loss_from_hidden` (checked there).
    """
    b, t, hdim = hidden.shape
    blocks = options or LmHeadBlockSizes()
    plan = _planner(b * t, hdim, fmt.vocab(lm_head), blocks)
    by_vocab = blocks.dweight == "vocab"
    tau = config.temperature
    trunc = config_truncation(config, fmt.vocab(lm_head))

    def planned_forward(p: _Plan, primals, batch, with_grad):
        rows = p.rows
        h, head = _rows_and_head(*primals, fmt, p.cpu)
        ids = batch.clamped_ids(head.vocab).reshape(-1)
        grad_fn, then, quantile = None, None, None
        if with_grad and token_separable(config):
            grad_fn = _token_grad_fn(batch, config)
        elif with_grad and separable_given_selection(config):  # one pass and a correction
            quantile = QuantilePass.estimate(h, ids, head, tau, rows, batch, config, trunc)
            grad_fn = quantile.grad_fn
            then = quantile.correction(h, ids, head, tau, _correction_rows(rows), p.dw_rows)
        stats, grads = head_sweep(h, ids, head, tau, rows, grad_fn, p.dw_rows,
                                  dweight=not by_vocab, then=then, trunc=trunc)
        (logp, lse, ent), floor = stats[:3], (stats[3] if trunc is not None else None)
        loss, metrics, row = batch.loss(logp.reshape(b, t), ent.reshape(b, t), config,
                                        with_grad=with_grad and grads is None)
        if trunc is not None:
            metrics["outside_truncation"] = outside_count(stats[4], batch.mask)
        if row is not None:  # not token-separable: a second pass with the gradient known
            row = row.map(lambda x: x.reshape(-1))
            _, grads = head_sweep(h, ids, head, tau, rows, _given_grad_fn(row), p.dw_rows,
                                  dweight=not by_vocab, floor=floor)
        elif grads is not None and by_vocab:
            row = grad_fn(0, b * t, logp) if quantile is None else quantile.exact(logp, ent)
            row = row if row.h is None else row._replace(entropy=ent)
        if grads is None or not by_vocab:
            return (loss, metrics), None if grads is None else _cast_grads(primals, *grads)
        return (loss, metrics), (grads[0], primals, ids, lse, row, floor)

    def forward(primals, batch, with_grad):
        return by_platform(lambda p, *a: planned_forward(p, *a, with_grad), plan, primals, batch)

    def planned_vocab_backward(p: _Plan, residuals, cotangent):
        # dW and db in the backward, so that the vocabulary pass writes the returned gradient
        # itself: formed in the forward, it would be a weight-sized residual and the
        # cotangent's product a second weight-sized array.
        dh, primals, ids, lse, row, floor = residuals
        h, head = _rows_and_head(*primals, fmt, p.cpu)
        dh, = scale_by_cotangent((dh,), cotangent)
        return _cast_grads(primals, dh, *vocab_sweep(h, ids, head, tau, lse,
                                                     row.scaled(cotangent), p.cols,
                                                     floor=floor)[:2])

    def vocab_backward(residuals, cotangent):
        return by_platform(planned_vocab_backward, plan, residuals, cotangent)

    backward = vocab_backward if by_vocab else scale_by_cotangent
    return loss_with_gradient(forward, backward)((hidden, lm_head, bias), batch)


def chunk_order(batch: int, time: int, parts: int, rows: int) -> np.ndarray:
    """The ``[batch * time]`` row order of a ``seq`` sweep (:func:`~.xla_sweep.head_sweep`):
    position ``p`` of the sweep holds the row-major ``[batch, time]`` row ``order[p]``.

    Each device holds ``time / parts`` consecutive steps of every sequence (``P(batch, axis)``
    on ``[B, T, H]``), as ``M = batch * time / parts`` local rows; a chunk of ``rows`` takes
    the next ``rows / parts`` local rows of device 0, then of device 1, and so on.
    """
    local, step = batch * time // parts, rows // parts
    r = np.arange(local)
    span = time // parts
    rows_of = ((r // span)[None, :] * time + np.arange(parts)[:, None] * span
               + (r % span)[None, :])  # [parts, local]: device d's local row -> global row
    full = local // step * step
    body = rows_of[:, :full].reshape(parts, -1, step).transpose(1, 0, 2).reshape(-1)
    return np.concatenate([body, rows_of[:, full:].reshape(-1)])


def gathered_pieces(hidden: Array, fmt: HeadFormat, options: LmHeadBlockSizes | None,
                    temperature: float, vocab: int, reduce_dh: Callable[[Array], Array],
                    fsdp: tuple[str, ...]):
    """:func:`pieces` for a head whose hidden dimension is split over the mesh axes ``fsdp``
    (inside ``shard_map``; FSDP-sharded weights, ``[H / f, V_k]`` per device), in
    vocabulary-major order: the statistics in one pass over blocks of columns
    (:func:`~.xla_vocab.vocab_stats`), the gradients in another
    (:func:`~.xla_vocab.vocab_sweep` with ``dh``), each block of ``W`` gathered over ``fsdp``
    when it is used and its ``dW`` reduce-scattered back. No device holds the whole ``[H,
    V_k]`` shard, its float32 gradient or a ``[B, T, V_k]`` array: per block ``[N, cols]``
    logits for this device's ``N`` tokens, and one ``[N, H]`` float32 sum for ``dhidden``.
    Four matmuls of the logits' size, as ``dweight="vocab"`` (which this mode always is).
    """
    b, t, hdim = hidden.shape
    plan = _planner(b * t, hdim, vocab, options or LmHeadBlockSizes())

    def planned_stats(p: _Plan, primals, ids):
        h, head = _rows_and_head(*primals, fmt, p.cpu)
        out = vocab_stats(h, ids.reshape(-1), head, temperature, p.cols, fsdp)
        return tuple(x.reshape(b, t) for x in out)

    def planned_grad(p: _Plan, primals, hit_ids, lse, row):
        h, head = _rows_and_head(*primals, fmt, p.cpu)
        flat = lambda x: x.reshape(-1)  # noqa: E731
        dw, db, dh = vocab_sweep(h, flat(hit_ids), head, temperature, flat(lse),
                                 row.map(flat), p.cols, fsdp, with_dh=True)
        return _cast_grads(primals, reduce_dh(dh), dw, db)

    def stats(primals, ids):
        return by_platform(planned_stats, plan, primals, ids)

    def grad(primals, hit_ids, lse, row):
        return by_platform(planned_grad, plan, primals, hit_ids, lse, row)

    return stats, grad


def pieces(hidden: Array, w: Array, fmt: HeadFormat, options: LmHeadBlockSizes | None,
           temperature: float, vocab: int, reduce_dh: Callable[[Array], Array],
           seq: tuple[str, int] | None = None, trunc: Truncation | None = None):
    """``(stats, grad)`` on this device's rows and head shard (see :mod:`grpo_kernels.sharding`):

    ``stats(primals, ids)`` -> the ``[B, T]`` ``(logp, lse, entropy)`` of the shard's columns;
    ``grad(primals, hit_ids, lse, row)`` -> ``(dhidden, dW, db)`` of the shard given the whole
    row's ``lse`` and :class:`RowGrad`, ``dhidden`` summed over shards chunk by chunk by
    ``reduce_dh``.
    ``vocab`` is the whole head's ``V``: the chunk is planned from it. With ``seq = (axis, k)``
    ``hidden`` is this device's ``[B, T / k, H]`` share of the steps (sequence-parallel over the
    vocab axis; :func:`~.xla_sweep.head_sweep`'s ``seq``), the ``[B, T]`` inputs and outputs
    are whole, and ``dhidden`` comes back as ``hidden``'s share.

    With the sampler's truncation ``trunc`` (the whole head on one device, no ``seq``):
    ``stats`` also gives each token's floor and whether its id lies below it (found in the
    statistics pass's chunks), and ``grad`` takes ``(ids, floor)`` for ``hit_ids``.
    """
    b, t, hdim = hidden.shape
    parts = 1 if seq is None else seq[1]
    t = t * parts
    # Planned as for the whole vocabulary, twice: the statistics and the gradient are separate
    # passes here (the gradient needs the global lse), and XLA keeps both passes' chunk buffers,
    # so each gets half of the one-pass budget. A sequence-parallel chunk takes as many rows
    # from every device.
    blocks = options or LmHeadBlockSizes()
    plan = _planner(b * t, hdim, vocab, blocks, chunk_vocab=2 * vocab, parts=parts)
    by_vocab = blocks.dweight == "vocab"
    if seq is not None and by_vocab:
        raise ValueError("LmHeadBlockSizes(dweight='vocab') needs every row on each device; "
                         "a sequence-parallel head sums dW by tokens (dweight='tokens')")

    def orders(p: _Plan) -> tuple[Callable[[Array], Array], Callable[[Array], Array]]:
        """``[B, T]`` -> the sweep's ``[N]`` row order of ``p``'s chunks, and back."""
        order = None if seq is None else chunk_order(b, t, parts, p.rows)
        inverse = None if order is None else np.argsort(order)

        def to_sweep(x: Array) -> Array:
            x = x.reshape(-1)
            return x if order is None else x[order]

        def from_sweep(x: Array) -> Array:
            return (x if inverse is None else x[inverse]).reshape(b, t)
        return to_sweep, from_sweep

    def planned_stats(p: _Plan, primals, ids):
        to_sweep, from_sweep = orders(p)
        h, head = _rows_and_head(*primals, fmt, p.cpu)
        out, _ = head_sweep(h, to_sweep(ids), head, temperature, p.rows, None, seq=seq,
                            trunc=trunc)
        return tuple(from_sweep(x) for x in out)

    def planned_grad(p: _Plan, primals, hit_ids, lse, row):
        to_sweep, _ = orders(p)
        h, head = _rows_and_head(*primals, fmt, p.cpu)
        floor = None
        if trunc is not None:
            hit_ids, floor = hit_ids
            floor = to_sweep(floor)
        ids, lse, row = to_sweep(hit_ids), to_sweep(lse), row.map(to_sweep)
        # dW update blocks of as many rows as the whole head's (p.dw_rows): the float32
        # product [rows, V_local] shrinks with the shard.
        _, grads = head_sweep(h, ids, head, temperature, p.rows, _given_grad_fn(row),
                              dw_rows=p.dw_rows, lse=lse, reduce_dh=reduce_dh,
                              dweight=not by_vocab, seq=seq, floor=floor)
        if by_vocab:
            grads = (grads[0], *vocab_sweep(h, ids, head, temperature, lse, row, p.cols,
                                            floor=floor)[:2])
        return _cast_grads(primals, *grads)

    def stats(primals, ids):
        return by_platform(planned_stats, plan, primals, ids)

    def grad(primals, hit_ids, lse, row):
        return by_platform(planned_grad, plan, primals, hit_ids, lse, row)

    return stats, grad
