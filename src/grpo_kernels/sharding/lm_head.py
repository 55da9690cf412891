"""``sharded_grpo_loss_from_hidden``: the fused LM-head GRPO loss under ``shard_map``.

Per device: hidden states ``[B/b, T, H]`` (whole along the vocab axis) and a tensor-parallel
head shard ``[H, V/k]`` (or ``[V/k, H]``), replicated over the batch axes. The chosen
implementation computes row statistics over the local columns, chunk by chunk as on one device;
:mod:`grpo_kernels.sharding.vocab` combines them. The backward is the implementation's gradient
pass on the local shard with the global ``lse``: ``dW`` (and ``db``) stay local to their shard
(``shard_map`` sums them over the batch axes, the usual data-parallel reduction), and ``dhidden``
is summed over the vocab axis, since every shard contributes ``delta_k W_k^T``.

The XLA implementation plans its chunk from the *whole* vocabulary, so a device's chunk holds as
many rows as on one device and its ``[c, V/k]`` logits and ``[H, V/k]`` float32 ``dW``
accumulator shrink by ``k``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from grpo_kernels.compat import vary
from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.ops.lm_head_loss import pallas_tpu
from grpo_kernels.ops.lm_head_loss import xla as xla_head
from grpo_kernels.ops.lm_head_loss.api import OPTION_TYPES, default_impl, validate_head
from grpo_kernels.ops.lm_head_loss.reference import head_logits
from grpo_kernels.ops.logits_loss.api import (
    _check_ids_in_range,
    as_num_items,
    resolve_impl,
    validate_inputs,
)
from grpo_kernels.sharding.logits import extra_inputs, metric_specs
from grpo_kernels.sharding.spec import ShardingSpec, resolve
from grpo_kernels.sharding.vocab import (
    combine,
    loss_and_metrics,
    reference_statistics,
    split_ids,
    with_softmax_gradient,
)

Array = jax.Array
_F32 = jnp.float32

# (stats((hidden, w, bias), ids [B, T]) -> (logp, lse, ent) [B, T];
#  grad((hidden, w, bias), hit_ids, lse, g) -> (dhidden, dw, dbias))
Kernels = tuple[Callable[..., tuple[Array, Array, Array]], Callable[..., Any]]


def _xla_kernels(hidden: Array, w: Array, *, layout: str, logits_dtype: Any, vocab: int,
                 tau: float, blocks: xla_head.LmHeadBlockSizes | None,
                 spec: ShardingSpec) -> Kernels:
    b, t, hdim = hidden.shape
    n = b * t
    compute = xla_head.common_dtype(hidden.dtype, w.dtype)
    # Planned as for the whole vocabulary, twice: the statistics and the gradient are separate
    # passes here (the gradient needs the global lse), and XLA keeps both passes' chunk buffers,
    # so each gets half of the one-pass budget.
    rows = xla_head.plan_chunk(n, 2 * vocab, blocks or xla_head.LmHeadBlockSizes(),
                               jax.default_backend())
    # dW update blocks of as many rows as the whole head's: the float32 product [rows, V_local]
    # shrinks with the shard.
    dw_rows = xla_head.dweight_rows(hdim, vocab)

    def parts(primals):
        hidden, w, bias = primals
        head = xla_head.Head(w.astype(compute), bias, layout, logits_dtype)
        return hidden.reshape(n, hdim).astype(compute), head

    def stats(primals, ids):
        h, head = parts(primals)
        out, _ = xla_head.head_sweep(h, ids.reshape(n), head, tau, rows, None)
        return tuple(x.reshape(b, t) for x in out)

    def grad(primals, hit_ids, lse, g):
        h, head = parts(primals)
        g = g.reshape(n)
        _, (dh, dw, db) = xla_head.head_sweep(
            h, hit_ids.reshape(n), head, tau, rows,
            lambda start, size, _: jax.lax.dynamic_slice_in_dim(g, start, size),
            dw_rows=dw_rows, lse=lse.reshape(n), reduce_dh=spec.vocab_sum)
        return _cast_grads(primals, dh, dw, db)

    return stats, grad


def _pallas_kernels(hidden: Array, w: Array, *, layout: str, logits_dtype: Any, vocab: int,
                    tau: float, blocks: pallas_tpu.LmHeadPallasOptions | None,
                    spec: ShardingSpec) -> Kernels:
    del vocab, spec  # the tiles follow the local shard; dh is summed by shard_map
    opts = blocks or pallas_tpu.LmHeadPallasOptions()
    interpret = "hlo" if opts.resolved_interpret() else False  # see LmHeadPallasOptions
    b, t, hdim = hidden.shape
    n = b * t
    compute = xla_head.common_dtype(hidden.dtype, w.dtype)
    v_local = w.shape[1] if layout == "hv" else w.shape[0]
    tiles = pallas_tpu.plan_tiles(n, hdim, v_local, opts)
    pad = -n % tiles.rows
    static = dict(layout=layout, logits_dtype=logits_dtype, temperature=tau, tiles=tiles,
                  interpret=interpret)

    def rows(x, fill=0):
        x = x.reshape(n, *x.shape[2:])
        return jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1), constant_values=fill)

    def stats(primals, ids):
        hidden, w, bias = primals
        out = pallas_tpu.head_statistics(rows(hidden.astype(compute)), w.astype(compute), bias,
                                         rows(ids), **static)
        return tuple(x[:n].reshape(b, t) for x in out)

    def grad(primals, hit_ids, lse, g):
        hidden, w, bias = primals
        dh, dw, db = pallas_tpu.head_gradients(
            rows(hidden.astype(compute)), w.astype(compute), bias, rows(hit_ids, -1), rows(lse),
            rows(g / tau), **static)
        return _cast_grads(primals, dh[:n], dw, db)

    return stats, grad


def _interpreted(impl: str, blocks: Any) -> bool:
    """Whether the Pallas kernels will run in JAX's HLO interpreter (CPU).

    That interpreter cannot type-check the mesh axes an array varies over, so ``shard_map``
    then runs with ``check_vma=False``; the gradients are the same either way (tested).
    """
    return impl == "pallas" and bool(
        (blocks or pallas_tpu.LmHeadPallasOptions()).resolved_interpret())


def _cast_grads(primals: Any, dh: Array, dw: Array, db: Array | None) -> Any:
    hidden, w, bias = primals
    return (dh.reshape(hidden.shape).astype(hidden.dtype), dw.astype(w.dtype),
            None if bias is None else db.astype(bias.dtype))


def _shard_loss(hidden, head, ids, mask, advantages, extra, *, config, spec, impl, block_sizes,
                layout, logits_dtype, vocab):
    """The loss on one device's rows and head shard; collectives go through ``spec``."""
    tau = config.temperature
    w, bias = head["w"], head.get("bias")
    owned, stat_ids, hit_ids = split_ids(ids, vocab, w.shape[1 if layout == "hv" else 0], spec)
    if impl == "reference":
        z = head_logits(hidden, w, layout, bias, logits_dtype)
        logp, ent = reference_statistics(z, hit_ids, tau, spec)
    else:
        make = _xla_kernels if impl == "xla" else _pallas_kernels
        stats, grad = make(hidden, w, layout=layout, logits_dtype=logits_dtype, vocab=vocab,
                           tau=tau, blocks=block_sizes, spec=spec)
        # The primals are made to vary over the axes their per-device cotangents do, so the
        # custom backward may return them; the transposed casts then sum dW and db over the
        # batch axes, and dhidden over the vocab axis, except where the XLA pass already
        # summed it chunk by chunk (then it does not vary over the vocab axis).
        tp = (spec.vocab_axis,) if spec.vocab_axis else ()
        hidden = vary(hidden, spec.batch_axes + (() if impl == "xla" else tp))
        primals = (hidden, *(None if x is None else vary(x, spec.batch_axes + tp)
                             for x in (w, bias)))
        logp_k, lse_k, ent_k = stats(jax.tree.map(jax.lax.stop_gradient, primals), stat_ids)
        part, lse, ent = combine(logp_k, lse_k, ent_k, owned, spec)
        logp = spec.vocab_sum(with_softmax_gradient(grad, primals, part, lse, hit_ids))
    return loss_and_metrics(logp, ent, mask, advantages, config, extra, spec)


def sharded_grpo_loss_from_hidden(
    hidden: Array,
    lm_head: Array,
    ids: Array,
    mask: Array,
    advantages: Array,
    *,
    mesh: Mesh,
    sharding: ShardingSpec,
    config: GRPOLossConfig,
    old_logps: Array | None = None,
    ref_logps: Array | None = None,
    num_items_in_batch: Array | float | None = None,
    impl: str = "auto",
    lm_head_layout: str = "hv",
    bias: Array | None = None,
    logits_dtype: Any = None,
    check_ids: bool = False,
    block_sizes: Any = None,
) -> tuple[Array, dict[str, Array]]:
    """:func:`grpo_kernels.grpo_loss_from_hidden` with ``B`` split over ``sharding.batch_axes``
    and the head's ``V`` over ``sharding.vocab_axis`` (a tensor-parallel head).

    Equal to the one-device loss; no ``[B, T, V]`` array exists on any device and nothing
    vocabulary-sized is gathered. Layout inside: ``hidden`` ``P(batch_axes, None, None)``;
    ``lm_head`` ``P(None, vocab_axis)`` for ``"hv"`` or ``P(vocab_axis, None)`` for ``"vh"``;
    ``bias`` ``P(vocab_axis)``; the rest as :func:`grpo_kernels.sharding.sharded_grpo_loss`.
    Gradients come back in the inputs' layouts: ``dlm_head`` sharded on ``V`` (summed over the
    batch axes), ``dhidden`` on ``B`` (summed over the vocab axis).

    Args:
      hidden, lm_head, ids, mask, advantages, config, old_logps, ref_logps,
        num_items_in_batch, impl, lm_head_layout, bias, logits_dtype, check_ids, block_sizes:
        as :func:`grpo_kernels.grpo_loss_from_hidden`.
      mesh: The device mesh.
      sharding: Which mesh axes split ``B`` and ``V``.

    Raises:
      ValueError: bad arguments, a mesh without the named axes, or ``B``/``V`` not divisible
        by their axes (nothing is padded).
    """
    vocab, logits_dtype = validate_head(hidden, lm_head, lm_head_layout, bias, logits_dtype)
    b, t, _ = hidden.shape
    validate_inputs(jax.ShapeDtypeStruct((b, t, vocab), logits_dtype), ids, mask, advantages,
                    config, old_logps, ref_logps)
    sharding = resolve(sharding, mesh, b, vocab, "hidden/lm_head")
    impl = resolve_impl(impl, block_sizes, OPTION_TYPES, default_impl)
    if check_ids:
        _check_ids_in_range(ids, mask, vocab)
    extra, extra_specs = extra_inputs(sharding, old_logps, ref_logps,
                                      as_num_items(num_items_in_batch))
    head, head_specs = {"w": lm_head}, {"w": sharding.head(lm_head_layout)}
    if bias is not None:
        head["bias"], head_specs["bias"] = bias, sharding.vector()
    body = functools.partial(_shard_loss, config=config, spec=sharding, impl=impl,
                             block_sizes=block_sizes, layout=lm_head_layout,
                             logits_dtype=logits_dtype, vocab=vocab)
    fn = jax.shard_map(
        body, mesh=mesh,
        in_specs=(sharding.rows(3), head_specs, sharding.rows(2), sharding.rows(2),
                  sharding.rows(1), extra_specs),
        out_specs=(PartitionSpec(), metric_specs(sharding)),
        check_vma=not _interpreted(impl, block_sizes))
    return fn(hidden, head, ids, mask, advantages, extra)
