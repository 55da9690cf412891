"""What the sharded ops' one body needs to know of each op, and that body's statistics.

An :class:`OpKind` names, for the logits op and the fused head, the local vocabulary of a
device's primals, their reference logits and the implementation's statistics and gradient
pieces on the local block. :func:`statistics` is the per-device body that both the losses
(:mod:`grpo_kernels.sharding.loss`) and the forward-only log-probs
(:mod:`grpo_kernels.sharding.logps`) run under ``shard_map``: the block's statistics,
combined across the vocab axis (:mod:`grpo_kernels.sharding.vocab`), with the gradient piece
attached.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from grpo_kernels.compat import vary
from grpo_kernels.ops.core.online_softmax import soft_cap
from grpo_kernels.ops.core.reference import truncated_token_logps
from grpo_kernels.ops.core.truncation import Truncation
from grpo_kernels.ops.core.vjp import with_softmax_gradient
from grpo_kernels.ops.lm_head_loss import pallas_tpu as head_pallas
from grpo_kernels.ops.lm_head_loss import xla as head_xla
from grpo_kernels.ops.lm_head_loss.head import HeadFormat, head_logits
from grpo_kernels.ops.logits_loss import pallas as logits_pallas
from grpo_kernels.ops.logits_loss import xla as logits_xla
from grpo_kernels.ops.logps.api import from_pieces
from grpo_kernels.sharding.spec import ShardingSpec
from grpo_kernels.sharding.vocab import combine, reference_statistics, split_ids

Array = jax.Array
Primals = tuple  # (logits,) or (hidden, lm_head, bias)
# stats(primals, ids [B, T]) -> (logp, lse, entropy) [B, T] over the local columns;
# grad(primals, hit_ids, lse, row: RowGrad) -> cotangents of the primals (same structure).
Pieces = tuple[Callable[[Primals, Array], tuple[Array, Array, Array]],
               Callable[[Primals, Array, Array, Array], Primals]]


@dataclasses.dataclass(frozen=True)
class OpKind:
    """What the one sharded body needs to know about an op.

    Attributes:
      local_vocab: ``V_k`` of this device's primals.
      reference_logits: The local ``[B, T, V_k]`` logits of the primals (``impl="reference"``).
      pieces: ``pieces(primals, impl, options, temperature, spec, vocab, trunc)``: the fast
        implementation's :data:`Pieces` on the local block (``trunc``: the sampler's
        truncation, whole rows only; :mod:`grpo_kernels.sharding.truncation`).
      vary: The primals typed as varying over the mesh axes their per-device cotangents vary
        over, so the custom backward may return them (see :func:`grpo_kernels.compat.vary`).
    """

    local_vocab: Callable[[Primals], int]
    reference_logits: Callable[[Primals], Array]
    pieces: Callable[..., Pieces]
    vary: Callable[[Primals, str, ShardingSpec], Primals] = lambda primals, impl, spec: primals


def on_mesh(options: Any, default: Any) -> Any:
    """Pallas options with interpret mode, if any, on JAX's HLO interpreter: the TPU
    interpreter makes every device wait for all the others at each kernel, which can deadlock
    against XLA:CPU's collectives."""
    options = options or default
    return dataclasses.replace(options, interpret="hlo") if options.resolved_interpret() \
        else options


@functools.lru_cache(maxsize=None)
def logits_kind(softcap: float | None) -> OpKind:
    """The logits op (its logits soft-capped with ``softcap``), one object per cap:
    ``logits_kind(None)`` is :data:`LOGITS`."""
    def pieces(primals, impl, options, tau, spec, vocab, trunc=None) -> Pieces:
        del spec, vocab
        (z,) = primals
        if impl == "xla":
            return logits_xla.pieces(z.shape, options, tau, softcap, trunc)
        opts = on_mesh(options, logits_pallas.PallasOptions())
        return logits_pallas.pieces(z.shape, z.dtype, opts, tau, softcap, trunc)

    return OpKind(local_vocab=lambda p: p[0].shape[-1],
                  reference_logits=lambda p: soft_cap(p[0].astype(jnp.float32), softcap),
                  pieces=pieces)


LOGITS = logits_kind(None)


@functools.lru_cache(maxsize=None)
def head_kind(fmt: HeadFormat, seq: tuple[str, int] | None = None) -> OpKind:
    """The fused head of format ``fmt`` (``seq``: sequence-parallel over that vocab axis,
    :func:`sequence_split`), one object per pair: the sharded entries' compiled programs are
    keyed by it."""
    def pieces(primals, impl, options, tau, spec, vocab, trunc=None) -> Pieces:
        hidden, w, _ = primals
        if impl == "xla" and spec.head_axes:
            return head_xla.gathered_pieces(hidden, fmt, options, tau, vocab, spec.vocab_sum,
                                            spec.head_axes)
        if impl == "xla":
            return head_xla.pieces(hidden, w, fmt, options, tau, vocab, spec.vocab_sum, seq,
                                   trunc)
        opts = on_mesh(options, head_pallas.LmHeadPallasOptions())
        return head_pallas.pieces(hidden, w, fmt, opts, tau, trunc=trunc)

    def vary_primals(primals, impl, spec):
        # dW and db vary over the batch axes and the vocab axis; dhidden over the batch axes,
        # and over the vocab axis too unless the XLA pass already summed it chunk by chunk
        # (sequence-parallel, each device has its own steps: it varies).
        tp = (spec.vocab_axis,) if spec.vocab_axis else ()
        hidden, w, bias = primals
        hidden = vary(hidden, spec.batch_axes + (() if impl == "xla" and seq is None else tp))
        return (hidden, *(None if x is None else vary(x, spec.batch_axes + tp)
                          for x in (w, bias)))

    return OpKind(local_vocab=lambda p: fmt.vocab(p[1]),
                  reference_logits=lambda p: soft_cap(head_logits(
                      p[0], p[1], fmt.layout, p[2], fmt.logits_dtype).astype(jnp.float32),
                      fmt.softcap),
                  pieces=pieces, vary=vary_primals)


def sequence_split(spec: ShardingSpec, mesh: Mesh, time: int, impl: str,
                    options: Any) -> tuple[str, int] | None:
    """``(vocab_axis, k)`` when the XLA head runs sequence-parallel over its vocab axis
    (``hidden`` split over ``T`` there, :func:`grpo_kernels.ops.lm_head_loss.xla.pieces`):
    with a vocab axis, ``T`` divisible by it and ``dW`` summed by tokens; else ``None``
    (``hidden`` whole on every device of the vocab axis; always with ``head_axes``, whose
    sweep is by vocabulary blocks)."""
    if impl != "xla" or spec.vocab_axis is None or spec.head_axes:
        return None
    k = mesh.shape[spec.vocab_axis]
    by_vocab = options is not None and getattr(options, "dweight", "tokens") == "vocab"
    return None if time % k or by_vocab else (spec.vocab_axis, k)


def statistics(primals: Primals, ids: Array, *, op: OpKind, spec: ShardingSpec, impl: str,
               options: Any, vocab: int, temperature: float, with_entropy: bool,
               trunc: Truncation | None = None) -> tuple[Array, Array, Array | None]:
    """Whole-row ``(logp, entropy, outside)`` ``[B/b, T]`` of one device's block: the
    implementation's statistics over the local columns combined across the vocab axis
    (:func:`~grpo_kernels.sharding.vocab.combine`), differentiable through its gradient piece
    on the local block (the entropy's gradient only ``with_entropy``). ``outside`` is None
    without the sampler's truncation ``trunc``; with it (whole rows on each device,
    :mod:`grpo_kernels.sharding.truncation`) the one-device truncated pieces run on the
    block."""
    owned, stat_ids, hit_ids = split_ids(ids, vocab, op.local_vocab(primals), spec)
    if impl == "reference" and trunc is not None:
        return truncated_token_logps(op.reference_logits(primals), stat_ids, temperature,
                                     None, trunc)
    if impl == "reference":
        return (*reference_statistics(op.reference_logits(primals), hit_ids, temperature,
                                      spec), None)
    stats, grad = op.pieces(primals, impl, options, temperature, spec, vocab, trunc)
    primals = op.vary(primals, impl, spec)
    if trunc is not None:
        return from_pieces(stats, grad, primals, stat_ids, with_entropy, truncated=True)
    logp_k, lse_k, ent_k = stats(jax.tree.map(jax.lax.stop_gradient, primals), stat_ids)
    part, ent_part, lse, ent = combine(logp_k, lse_k, ent_k, owned, spec)
    part, ent_part = with_softmax_gradient(grad, with_entropy, primals, part, ent_part, lse,
                                           ent, hit_ids)
    logp = spec.vocab_sum(part)
    if with_entropy:
        ent = spec.vocab_sum(ent_part)
    return logp, ent, None


def head_spec(spec: ShardingSpec, mesh: Mesh, impl: str, hidden: int) -> ShardingSpec:
    """``spec`` for a hidden-state op: its ``head_axes`` kept only for the xla head (the
    others take the head with ``H`` whole), and then checked against ``hidden``."""
    if impl != "xla":
        return spec.whole_head()
    spec.check_head(mesh, hidden, "hidden/lm_head")
    return spec
