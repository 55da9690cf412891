r"""Fused LM-head GRPO loss in XLA: token chunks, gradients formed in the forward pass.

The hidden states ``[B, T, H]`` are viewed as ``N = B*T`` rows ``h_n``; the head is
``W [H, V]`` (layout ``"hv"``) or ``[V, H]`` (``"vh"``), with an optional bias ``b [V]``. One
loop over chunks of ``c`` rows does, per chunk, in float32 arithmetic:

.. math::

    z &= \mathrm{cast}_{\text{logits\_dtype}}(h W + b), \qquad s = z / \tau
      \qquad ([c, V],\ \text{the only vocabulary-sized arrays}) \\
    \mathrm{lse}, H, \log\pi(y) &\ \text{from the online-softmax statistics of } s
      \ (\text{:mod:`grpo_kernels.ops.logits_loss.online_softmax`}) \\
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
gradient is formed in the same pass. At sequence level (GSPO) ``g`` needs the whole sequence;
the op then runs the loop twice: statistics first (one matmul), then the gradient pass with
``g`` known (three more).

Peak temporary memory is ``O(c V)`` plus the ``[H, V]`` float32 accumulator and ``[N, H]`` for
``dhidden``: no ``[N, V]`` array exists. ``c`` comes from a byte budget over ``V``
(:func:`plan_chunk`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from grpo_kernels.compat import vary_like
from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective import (
    loss_from_token_stats,
    token_loss_grad,
    token_separable,
    token_weights,
)
from grpo_kernels.ops.logits_loss.online_softmax import block_stats, finish, merge_stats, sweep
from grpo_kernels.ops.logits_loss.xla import cast_to, zero_cotangent

Array = jax.Array
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class LmHeadBlockSizes:
    """Chunking of the fused LM-head loop.

    Attributes:
      chunk_tokens: Rows (tokens) per chunk; ``None`` derives it from ``chunk_bytes``.
      chunk_bytes: Target size of one chunk's vocabulary-sized work arrays (float32 logits plus
        the logits-dtype gradient); ``None`` picks a backend default.
    """

    chunk_tokens: int | None = None
    chunk_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("chunk_tokens", "chunk_bytes"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(
                    f"LmHeadBlockSizes.{name} must be None or an int >= 1, got {value!r}")


# Byte budget of one chunk's [c, V] float32 logits. CPU: measured on the 2-core development
# machine (docs/lm_head.md). GPU: an H100 ran B=1, T=8192, H=4096, V=151,936 bf16 within 1.10x
# of three matmuls at every chunk from 1760 to 8192 rows, and 2048 rows planned the smallest
# temporaries (docs/benchmarks.md); 2 GiB rounded down to a power of two gives 2048 there.
# TPU: not measured yet.
_DEFAULT_CHUNK_BYTES = {"cpu": 32 << 20, "gpu": 2 << 30, "tpu": 1 << 30}
# Backends whose planned rows are rounded down to a power of two, so that power-of-two token
# counts split into equal chunks with no separately compiled tail.
_POW2_CHUNKS = frozenset({"gpu"})


def plan_chunk(n_rows: int, vocab: int, blocks: LmHeadBlockSizes, backend: str) -> int:
    """Rows per chunk: the byte budget over a row's float32 logits, a multiple of 8 (a power
    of two on GPU).

    A row costs ``4 V`` bytes of float32 logits (plus its narrower gradient); the ``[c, H]``
    buffers are small beside them and do not enter. On the development CPU the default
    (256 rows at ``V = 32768``) is about 1.2x faster than 128 rows and keeps the temporaries
    under a tenth of the reference's for bfloat16 and float32 alike (docs/lm_head.md).
    """
    if blocks.chunk_tokens is not None:
        return min(blocks.chunk_tokens, n_rows)
    budget = blocks.chunk_bytes or _DEFAULT_CHUNK_BYTES.get(backend, 256 << 20)
    rows = max(8, budget // (4 * vocab) // 8 * 8)
    if backend in _POW2_CHUNKS:
        rows = max(8, 1 << (rows.bit_length() - 1))
    return min(rows, n_rows)


def common_dtype(a: Any, b: Any) -> jnp.dtype:
    """The dtype two matmul operands are brought to: theirs if equal, else float32."""
    a, b = jnp.dtype(a), jnp.dtype(b)
    return a if a == b else jnp.dtype(_F32)


def delta_dtype(logits_dtype: Any, operand_dtype: Any) -> jnp.dtype:
    """The dtype of ``delta``, the logits' gradient that the two gradient matmuls take: the
    narrower of the logits dtype and the matmul operands' dtype.

    An f32 head on 16-bit operands (``logits_dtype=float32``) keeps its logits and statistics
    in float32 but multiplies a 16-bit ``delta`` by the 16-bit ``W`` (float32 accumulation), as
    mixed-precision training does. A float32 ``delta`` would upcast ``W`` every chunk and run
    both matmuls at float32 speed (2-3x slower on the development CPU, docs/lm_head.md).
    """
    logits, operands = jnp.dtype(logits_dtype), jnp.dtype(operand_dtype)
    return logits if logits.itemsize <= operands.itemsize else operands


def matmul(a: Array, b: Array, dims: Any) -> Array:
    """``dot_general`` with float32 accumulation, operands in their :func:`common_dtype`."""
    dtype = common_dtype(a.dtype, b.dtype)
    return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (dims, ((), ())),
                               preferred_element_type=_F32)


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
    output directly); the integer form of :func:`grpo_kernels.ops.logits_loss.xla.to_bfloat16`
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
    """The LM head: weights in one of two layouts, an optional bias, the logits dtype."""

    w: Array
    bias: Array | None
    layout: str
    logits_dtype: Any

    @property
    def vocab(self) -> int:
        return self.w.shape[1] if self.layout == "hv" else self.w.shape[0]

    def logits(self, h: Array) -> Array:
        """``cast(h W + b)`` for rows ``h [c, H]``: float32 accumulation, one rounding.

        bfloat16 logits on CPU come back as float32 arrays holding the rounded values
        (:func:`round_to_bfloat16`), which XLA:CPU fuses into the softmax reductions.
        """
        k = 0 if self.layout == "hv" else 1
        z = matmul(h, self.w, ((1,), (k,)))
        if self.bias is not None:
            z = z + self.bias.astype(_F32)[None, :]
        dtype = jnp.dtype(self.logits_dtype)
        if dtype == _F32:
            return z
        if dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
            return round_to_bfloat16(z)
        return cast_to(z, dtype)

    def dhidden(self, delta: Array) -> Array:
        """``delta W^T`` for ``delta [c, V]``: ``[c, H]`` float32."""
        k = 1 if self.layout == "hv" else 0
        return matmul(delta, self.w, ((1,), (k,)))


# Vocabulary columns per block of a chunk's softmax statistics, by backend (absent: whole rows).
STATS_BLOCK = {"cpu": 4096}


def chunk_stats(s: Array, block: int | None) -> tuple[Array, Array, Array]:
    """``(m, S, Q)`` of each row of ``s [c, V]`` (:func:`block_stats`), over vocabulary blocks
    of ``block`` columns merged online (:func:`merge_stats`); ``None``: whole rows at once.

    On CPU the entropy's two sums over a whole row made XLA materialise ``exp(s - m)`` and
    ``exp(s - m) (s - m)`` as two float32 ``[c, V]`` arrays; over 4096-column blocks those are
    small, and a 256-row chunk at ``V = 32768`` keeps its temporaries 16 MiB lower and ran as
    fast (docs/lm_head.md).
    """
    rows, vocab = s.shape
    if block is None or vocab <= block:
        return block_stats(s)

    def body(col, width, acc):
        return merge_stats(acc, block_stats(jax.lax.dynamic_slice_in_dim(s, col, width, axis=1)))

    init = (jnp.full((rows,), -jnp.inf, _F32), jnp.zeros((rows,), _F32),
            jnp.zeros((rows,), _F32))
    return sweep(vocab, block, body, init, like=(s,))


def _rows(x: Array | None, start: Any, size: int) -> Array | None:
    return None if x is None else jax.lax.dynamic_slice_in_dim(x, start, size)


def _as_bits(x: Array) -> Array:
    """A same-width unsigned view of 16-bit floats (XLA:CPU has no bfloat16 update-slice)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 else x


def _from_bits(x: Array, dtype: Any) -> Array:
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != jnp.dtype(dtype) else x


def _slice_rows(x: Array, start: Any, size: int, axis: int = 0) -> Array:
    """``x[start:start+size]`` along ``axis``; 16-bit floats through an integer view."""
    return _from_bits(jax.lax.dynamic_slice_in_dim(_as_bits(x), start, size, axis=axis), x.dtype)


GradFn = Callable[[Any, int, Array], Array]

# float32 elements of one dW update product [rows, V] on CPU (16 MiB; docs/lm_head.md).
DWEIGHT_ELEMENTS = 1 << 22


def dweight_rows(hidden: int, vocab: int, backend: str | None = None) -> int:
    """Rows of ``dW [H, V]`` per update.

    CPU: :data:`DWEIGHT_ELEMENTS` over ``V``, a multiple of 8, at most ``H``. A vocabulary
    shard passes the global ``V`` (its product shrinks with it). GPU and TPU: all ``H`` rows,
    one ``[H, c] x [c, V]`` product per chunk. Row blocks of a few dozen rows are skinny
    matmuls that each re-read the whole ``delta``; on an H100 they made the fused op 2x slower
    than the materialised reference (docs/benchmarks.md).
    """
    if (backend or jax.default_backend()) != "cpu":
        return hidden
    return min(hidden, max(8, DWEIGHT_ELEMENTS // vocab // 8 * 8))


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
    operands and ran 2-3x slower there; its ``[V, H]`` result is one transpose of the
    accumulator at the end.
    """
    def body(row, height, acc):
        upd = matmul(_slice_rows(hc_t, row, height), delta, ((1,), (0,)))
        old = jax.lax.dynamic_slice(acc, (row, 0), upd.shape)
        return jax.lax.dynamic_update_slice(acc, old + upd, (row, 0))

    return sweep(dw.shape[0], min(rows, dw.shape[0]), body, dw, like=(hc_t, delta))


def head_sweep(h: Array, ids: Array, head: Head, temperature: float, rows: int,
               grad_fn: GradFn | None, dw_rows: int | None = None,
               lse: Array | None = None,
               reduce_dh: Callable[[Array], Array] | None = None,
               ) -> tuple[tuple[Array, Array, Array], Any]:
    """One pass over chunks of ``rows`` tokens.

    Args:
      h: ``[N, H]`` hidden states.
      ids: ``[N]`` int32 chosen ids in ``[0, V)``; in a gradient pass an id of ``-1`` means
        "no column of this head" (a vocabulary shard that does not own the token, see
        :mod:`grpo_kernels.sharding`): its one-hot term is zero and its statistics are junk.
      head: The LM head.
      temperature: Softmax temperature.
      rows: Rows per chunk.
      grad_fn: ``None`` for statistics only; else ``grad_fn(start, size, logp_chunk)`` returns
        the chunk's ``g = dL/dlogp`` and the pass also forms the gradients.
      dw_rows: Rows of ``dW`` per update (default :func:`dweight_rows` of this head).
      lse: ``[N]`` logsumexp to use in the gradient instead of the one of these columns (the
        whole-row value when the head is a vocabulary shard); ``None``: this pass's own.
      reduce_dh: Applied to each chunk's float32 ``dh`` before it is stored: the ``psum`` over
        the vocab axis when the head is a vocabulary shard, so that no ``[N, H]`` partial sum
        is ever held (:mod:`grpo_kernels.sharding`).

    Returns:
      ``((logp, lse, entropy), grads)``: three ``[N]`` float32 vectors, and ``None`` or
      ``(dh [N, H] in h's dtype, dW float32 in W's layout, db [V] float32 or None)``.
    """
    n, hidden = h.shape
    vocab = head.vocab
    dw_rows = dw_rows or dweight_rows(hidden, vocab)
    stats_block = STATS_BLOCK.get(jax.default_backend())

    def chunk(start, size, carry):
        stats, grads = carry
        hc = _slice_rows(h, start, size)
        idc = jax.lax.dynamic_slice_in_dim(ids, start, size)
        z = head.logits(hc)
        if z.dtype.itemsize < 4:  # keep the rounded logits narrow; consumers upcast on the fly
            z = jax.lax.optimization_barrier(z)
        s = z.astype(_F32) / temperature
        chosen = jnp.take_along_axis(s, jnp.clip(idc, 0, vocab - 1)[:, None], axis=1)[:, 0]
        logp, lse_c, ent = finish(*chunk_stats(s, stats_block), chosen)
        stats = tuple(jax.lax.dynamic_update_slice_in_dim(o, x, start, 0)
                      for o, x in zip(stats, (logp, lse_c, ent), strict=True))
        if grads is None:
            return stats, None
        dh_bits, dw, db = grads
        coef = (grad_fn(start, size, logp) / temperature)[:, None]
        hit = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1) == idc[:, None]
        if lse is not None:
            lse_c = jax.lax.dynamic_slice_in_dim(lse, start, size)
        delta = cast_to(coef * (hit.astype(_F32) - jnp.exp(s - lse_c[:, None])),
                        delta_dtype(head.logits_dtype, head.w.dtype))
        dhc = head.dhidden(delta)
        dhc = _as_bits((dhc if reduce_dh is None else reduce_dh(dhc)).astype(h.dtype))
        dh_bits = jax.lax.dynamic_update_slice_in_dim(dh_bits, dhc, start, 0)
        dw = _accumulate_dweight(dw, jax.lax.optimization_barrier(hc.T), delta, dw_rows)
        if db is not None:
            db = db + jnp.sum(delta.astype(_F32), axis=0)
        return stats, (dh_bits, dw, db)

    # Inside shard_map the carries are typed like the data each is made of; a dh that is
    # summed over the vocab axis per chunk does not vary over it.
    like = (h, ids, head.w) + (() if lse is None else (lse,))
    stats0 = vary_like(tuple(jnp.zeros((n,), _F32) for _ in range(3)), *like)
    grads0 = None
    if grad_fn is not None:
        dh0 = _as_bits(jnp.zeros((n, hidden), h.dtype))
        dh0 = vary_like(dh0, h) if reduce_dh is not None else vary_like(dh0, *like)
        grads0 = (dh0, vary_like(jnp.zeros((hidden, vocab), _F32), *like),
                  None if head.bias is None else vary_like(jnp.zeros((vocab,), _F32), *like))
    stats, grads = sweep(n, rows, chunk, (stats0, grads0))
    if grads is not None:
        dh, dw, db = grads
        grads = (_from_bits(dh, h.dtype), dw if head.layout == "hv" else dw.T, db)
    return stats, grads


def _flat(x: Array | None) -> Array | None:
    return None if x is None else x.reshape(-1).astype(_F32)


def _forward(hidden, w, bias, ids, mask, advantages, old, ref, num_items, *, config, layout,
             logits_dtype, rows, with_grad):
    b, t, hdim = hidden.shape
    compute = common_dtype(hidden.dtype, w.dtype)
    head = Head(w.astype(compute), bias, layout, logits_dtype)  # a mix: W upcast once
    h = hidden.reshape(b * t, hdim).astype(compute)
    ids = jnp.clip(ids.astype(jnp.int32), 0, head.vocab - 1).reshape(-1)
    tau = config.temperature

    grad_fn = None
    if with_grad and token_separable(config):
        weights = _flat(token_weights(mask, config, num_items))
        adv = _flat(jnp.broadcast_to(advantages.astype(_F32)[:, None], (b, t)))
        old_f, ref_f = _flat(old), _flat(ref)

        def grad_fn(start, size, logp):
            return token_loss_grad(logp, _rows(weights, start, size), _rows(adv, start, size),
                                   config, _rows(old_f, start, size), _rows(ref_f, start, size))

    (logp, _, ent), grads = head_sweep(h, ids, head, tau, rows, grad_fn)
    loss, metrics, g = loss_from_token_stats(
        logp.reshape(b, t), ent.reshape(b, t), mask, advantages, config, old, ref, num_items,
        with_grad=with_grad and grads is None)
    if g is not None:  # sequence level: a second pass with g known
        g_flat = g.reshape(-1)
        _, grads = head_sweep(h, ids, head, tau, rows,
                              lambda start, size, _: jax.lax.dynamic_slice_in_dim(
                                  g_flat, start, size))
    if grads is None:
        return loss, metrics, None
    dh, dw, db = grads
    return loss, metrics, (dh.reshape(hidden.shape).astype(hidden.dtype), dw.astype(w.dtype),
                           None if db is None else db.astype(bias.dtype))


def xla_lm_head_loss(
    hidden: Array,
    lm_head: Array,
    ids: Array,
    mask: Array,
    advantages: Array,
    *,
    config: GRPOLossConfig,
    old_logps: Array | None = None,
    ref_logps: Array | None = None,
    num_items_in_batch: Array | None = None,
    lm_head_layout: str = "hv",
    bias: Array | None = None,
    logits_dtype: Any = None,
    block_sizes: LmHeadBlockSizes | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Fused, chunked GRPO loss from hidden states; differentiable w.r.t. hidden, head, bias.

    Args, returns: as :func:`grpo_kernels.grpo_loss_from_hidden` (``logits_dtype`` resolved).
    """
    b, t, _ = hidden.shape
    logits_dtype = jnp.dtype(logits_dtype or common_dtype(hidden.dtype, lm_head.dtype))
    vocab = lm_head.shape[1] if lm_head_layout == "hv" else lm_head.shape[0]
    rows = plan_chunk(b * t, vocab, block_sizes or LmHeadBlockSizes(), jax.default_backend())
    static = dict(config=config, layout=lm_head_layout, logits_dtype=logits_dtype, rows=rows)
    rest = (ids, mask, advantages, old_logps, ref_logps, num_items_in_batch)

    @jax.custom_vjp
    def loss_fn(hidden, w, bias, rest):
        loss, metrics, _ = _forward(hidden, w, bias, *rest, **static, with_grad=False)
        return loss, metrics

    def loss_fwd(hidden, w, bias, rest):
        loss, metrics, grads = _forward(hidden, w, bias, *rest, **static, with_grad=True)
        return (loss, metrics), (grads, rest)

    def loss_bwd(res, cotangents):
        grads, rest = res
        ct = cotangents[0].astype(_F32)
        scaled = tuple(None if x is None else cast_to(x.astype(_F32) * ct, x.dtype)
                       for x in grads)
        return (*scaled, jax.tree.map(zero_cotangent, rest, is_leaf=lambda x: x is None))

    loss_fn.defvjp(loss_fwd, loss_bwd)
    return loss_fn(hidden, lm_head, bias, rest)
