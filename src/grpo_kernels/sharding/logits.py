"""``sharded_grpo_loss``: the logits-level GRPO loss under ``shard_map``.

Per device: logits ``[B/b, T, V/k]`` (``b`` = product of the batch axes, ``k`` = the vocab
axis). The chosen implementation computes each row's statistics over the local columns;
:mod:`grpo_kernels.sharding.vocab` combines them across the vocab axis; the objective is
normalised over the whole batch through ``psum`` over the batch axes. ``dlogits`` comes out
sharded like the logits: the backward is the implementation's own gradient kernel on the local
block, fed the global ``lse``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.ops.logits_loss import pallas as pallas_impl
from grpo_kernels.ops.logits_loss import xla as xla_impl
from grpo_kernels.ops.logits_loss.api import (
    OPTION_TYPES,
    _check_ids_in_range,
    as_num_items,
    default_impl,
    resolve_impl,
    validate_inputs,
)
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

# (stats(z [B, T, V_k], ids [B, T]) -> (logp, lse, ent) [B, T];
#  grad(z, hit_ids, lse, g) -> dz [B, T, V_k])
Kernels = tuple[Callable[..., tuple[Array, Array, Array]], Callable[..., Array]]


def _xla_kernels(z: Array, blocks: xla_impl.XlaBlockSizes | None, tau: float) -> Kernels:
    b, t, vocab = z.shape
    rows, block_v = xla_impl.plan_blocks(b * t, vocab, blocks or xla_impl.XlaBlockSizes(),
                                         jax.default_backend())

    def stats(z, ids):
        out = xla_impl.row_statistics(z, ids.reshape(-1), tau, rows, block_v)
        return tuple(x.reshape(b, t) for x in out)

    def grad(z, hit_ids, lse, g):
        return xla_impl.logits_gradient(z, hit_ids, lse, g, tau)

    return stats, grad


def _pallas_kernels(z: Array, opts: pallas_impl.PallasOptions | None, tau: float) -> Kernels:
    b, t, vocab = z.shape
    n = b * t
    opts = opts or pallas_impl.PallasOptions()
    if opts.resolved_interpret():  # see PallasOptions.interpret
        opts = dataclasses.replace(opts, interpret="hlo")
    row_stats, row_grad = pallas_impl.kernels(z, opts)

    def stats(z, ids):
        out = row_stats(z.reshape(n, vocab), ids.reshape(n), tau)
        return tuple(x.reshape(b, t) for x in out)

    def grad(z, hit_ids, lse, g):
        dz = row_grad(z.reshape(n, vocab), hit_ids.reshape(n), lse.reshape(n),
                      (g / tau).reshape(n), tau)
        return dz.reshape(b, t, vocab)

    return stats, grad


def _shard_loss(z, ids, mask, advantages, extra, *, config, spec, impl, block_sizes, vocab):
    """The loss on one device's block; every collective goes through ``spec``."""
    tau = config.temperature
    owned, stat_ids, hit_ids = split_ids(ids, vocab, z.shape[-1], spec)
    if impl == "reference":
        logp, ent = reference_statistics(z, hit_ids, tau, spec)
    else:
        make = _xla_kernels if impl == "xla" else _pallas_kernels
        stats, grad = make(z, block_sizes, tau)
        logp_k, lse_k, ent_k = stats(jax.lax.stop_gradient(z), stat_ids)
        part, lse, ent = combine(logp_k, lse_k, ent_k, owned, spec)
        logp = spec.vocab_sum(with_softmax_gradient(grad, z, part, lse, hit_ids))
    return loss_and_metrics(logp, ent, mask, advantages, config, extra, spec)


def extra_inputs(spec: ShardingSpec, old_logps: Any, ref_logps: Any,
                 num_items: Any) -> tuple[dict[str, Array], dict[str, PartitionSpec]]:
    """The optional inputs that are present, and their partition specs."""
    extra, specs = {}, {}
    for key, x, p in (("old", old_logps, spec.rows(2)), ("ref", ref_logps, spec.rows(2)),
                      ("num_items", num_items, PartitionSpec())):
        if x is not None:
            extra[key], specs[key] = x, p
    return extra, specs


def metric_specs(spec: ShardingSpec) -> dict[str, PartitionSpec]:
    scalar = PartitionSpec()
    return {"logp": spec.rows(2), "clip_ratio_low": scalar, "clip_ratio_high": scalar,
            "clip_ratio_region": scalar, "kl": scalar, "entropy": scalar}


def sharded_grpo_loss(
    logits: Array,
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
    check_ids: bool = False,
    block_sizes: Any = None,
) -> tuple[Array, dict[str, Array]]:
    r""":func:`grpo_kernels.grpo_loss` with ``B`` split over ``sharding.batch_axes`` and ``V``
    over ``sharding.vocab_axis`` of ``mesh``.

    Equal to the one-device loss (every normaliser is a whole-batch figure; ``num_items_in_batch``
    is the whole batch's). Inputs may arrive with any sharding (under ``jit`` XLA moves them to
    the layout below); nothing of size ``[B, T, V]`` is gathered.

    Layout inside: ``logits`` ``P(batch_axes, None, vocab_axis)``; ``[B, T]`` inputs and the
    ``logp`` metric ``P(batch_axes, None)``; ``advantages`` ``P(batch_axes)``; the loss and the
    scalar metrics replicated. The gradient w.r.t. ``logits`` has the logits' layout.

    Args:
      logits, ids, mask, advantages, config, old_logps, ref_logps, num_items_in_batch, impl,
        check_ids, block_sizes: as :func:`grpo_kernels.grpo_loss`; ``block_sizes`` applies to
        each device's block.
      mesh: The device mesh.
      sharding: Which mesh axes split ``B`` and ``V``.

    Raises:
      ValueError: bad arguments (as ``grpo_loss``), a mesh without the named axes, or ``B``/``V``
        not divisible by their axes (nothing is padded).
    """
    validate_inputs(logits, ids, mask, advantages, config, old_logps, ref_logps)
    b, _, vocab = logits.shape
    sharding = resolve(sharding, mesh, b, vocab, "logits")
    impl = resolve_impl(impl, block_sizes, OPTION_TYPES, default_impl)
    if check_ids:
        _check_ids_in_range(ids, mask, vocab)
    extra, extra_specs = extra_inputs(sharding, old_logps, ref_logps,
                                      as_num_items(num_items_in_batch))
    body = functools.partial(_shard_loss, config=config, spec=sharding, impl=impl,
                             block_sizes=block_sizes, vocab=vocab)
    fn = jax.shard_map(
        body, mesh=mesh,
        in_specs=(sharding.logits(), sharding.rows(2), sharding.rows(2), sharding.rows(1),
                  extra_specs),
        out_specs=(PartitionSpec(), metric_specs(sharding)),
        check_vma=not (impl == "pallas"
                       and (block_sizes or pallas_impl.PallasOptions()).resolved_interpret()))
    return fn(logits, ids, mask, advantages, extra)
