r"""The one ``custom_vjp`` of every fast backend: the gradient is formed in the forward pass.

A fast backend computes, in one forward, the loss, its metrics and everything the gradient
needs (the gradient itself, or the ``O(N)`` residuals a gradient kernel reads). Its backward
only multiplies by the loss cotangent :math:`\bar L` (or hands it to the gradient kernel). The
per-token inputs (:class:`~grpo_kernels.objective.batch.TokenBatch`) get zero cotangents: the
loss is differentiable w.r.t. the primals only, as TRL's is w.r.t. the logits.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from grpo_kernels.objective import RowGrad
from grpo_kernels.ops.core.dtypes import F32, cast_to
from grpo_kernels.ops.core.truncation import outside_count

Array = jax.Array
# forward(primals, batch, with_grad) -> ((loss, metrics), residuals)
Forward = Callable[[tuple, Any, bool], tuple[tuple[Array, dict[str, Array]], Any]]
# backward(residuals, loss_cotangent float32) -> cotangents of the primals (same structure)
Backward = Callable[[Any, Array], tuple]


def zero_cotangent(x: Array | None) -> Any:
    """The zero cotangent of ``x``: zeros for floats, ``float0`` for integers, ``None`` kept."""
    if x is None:
        return None
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


def zero_cotangents(tree: Any) -> Any:
    """:func:`zero_cotangent` of every leaf of ``tree``."""
    return jax.tree.map(zero_cotangent, tree, is_leaf=lambda x: x is None)


def scale_by_cotangent(grads: tuple, cotangent: Array) -> tuple:
    """``grads`` (formed for a unit cotangent) times the loss cotangent, each in its dtype.

    The product is one elementwise op that XLA fuses into the kernel that wrote each gradient.
    """
    return tuple(None if g is None else cast_to(g.astype(F32) * cotangent, g.dtype)
                 for g in grads)


def loss_with_gradient(forward: Forward, backward: Backward = scale_by_cotangent,
                       ) -> Callable[[tuple, Any], tuple[Array, dict[str, Array]]]:
    """``loss(primals, batch) -> (loss, metrics)`` differentiable w.r.t. ``primals``.

    Args:
      forward: ``forward(primals, batch, with_grad)`` returns ``((loss, metrics), residuals)``;
        with ``with_grad=False`` (a primal-only call) the residuals are ignored and need not
        be computed.
      backward: ``backward(residuals, cotangent)`` returns the cotangents of ``primals`` (a
        tuple of their structure; ``None`` for a ``None`` primal). Default: the residuals are
        the gradients themselves, scaled by :func:`scale_by_cotangent`.
    """

    @jax.custom_vjp
    def loss(primals, batch):
        return forward(primals, batch, False)[0]

    def loss_fwd(primals, batch):
        out, residuals = forward(primals, batch, True)
        return out, (residuals, batch)

    def loss_bwd(saved, cotangents):
        residuals, batch = saved
        return backward(residuals, cotangents[0].astype(F32)), zero_cotangents(batch)

    loss.defvjp(loss_fwd, loss_bwd)
    return loss


def loss_from_pieces(stats: Callable, grad: Callable, ids: Array, config: Any,
                     primals: tuple, batch: Any,
                     truncated: bool = False) -> tuple[Array, dict[str, Array]]:
    """The loss of a backend given as statistics and gradient pieces (the Pallas kernels).

    ``stats(primals, ids)`` gives the ``[B, T]`` ``(logp, lse, entropy)``; the forward turns
    them into the loss and its :class:`~grpo_kernels.objective.RowGrad` (``batch.loss``) and
    keeps ``(primals, lse, row_grad)``, ``O(N)`` beyond the primals; the backward runs
    ``grad(primals, ids, lse, row_grad.scaled(cotangent))``.

    ``truncated``: pieces made for a sampler's truncation
    (:mod:`grpo_kernels.ops.core.truncation`): ``stats`` also gives each row's floor and
    whether its id lies below it, the metrics gain ``outside_truncation``, and ``grad`` takes
    ``(ids, floor)`` for ``ids``.
    """

    def forward(primals, batch, with_grad):
        out = stats(primals, ids)
        logp, lse, entropy = out[:3]
        loss, metrics, row_grad = batch.loss(logp, entropy, config, with_grad)
        targets = ids
        if truncated:
            targets = (ids, out[3])
            metrics = {**metrics, "outside_truncation": outside_count(out[4], batch.mask)}
        return (loss, metrics), (primals, targets, lse, row_grad)

    def backward(residuals, cotangent):
        primals, targets, lse, row_grad = residuals
        return grad(primals, targets, lse, row_grad.scaled(cotangent))

    return loss_with_gradient(forward, backward)(primals, batch)


GradFn = Callable[[Any, Array, Array, RowGrad], Any]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def with_softmax_gradient(grad_fn: GradFn, with_entropy: bool, primals: Any, logp: Array,
                          ent: Array, lse: Array, entropy: Array,
                          hit_ids: Array) -> tuple[Array, Array]:
    r"""Log-probs and entropies computed without gradient (one device's, or a vocabulary
    shard's ``parts`` from :func:`grpo_kernels.sharding.vocab.combine`), given the softmax
    gradient w.r.t. the ``primals`` they came from.

    The backward calls ``grad_fn(primals, hit_ids, lse, RowGrad(g, h, entropy))`` with
    :math:`g = \bar{\log\pi}` and :math:`h = \bar H` (``[B, T]``; ``h`` only
    ``with_entropy``, the whole-row ``entropy`` beside it) and returns its cotangents for
    ``primals``: the implementation's kernel for :math:`\partial L/\partial z` on the local
    columns (:func:`grpo_kernels.ops.core.online_softmax.softmax_grad`), pulled back to the
    inputs (logits, or hidden states and head). On a vocabulary shard the parts of shard ``j``
    depend on the columns of shard ``j`` only here, so the sum over shards has exactly the true
    derivative.
    """
    del grad_fn, with_entropy, primals, lse, entropy, hit_ids
    return logp, ent


def _fwd(grad_fn, with_entropy, primals, logp, ent, lse, entropy, hit_ids):
    del grad_fn, with_entropy
    return (logp, ent), (primals, logp, ent, lse, entropy, hit_ids)


def _bwd(grad_fn, with_entropy, res, cts):
    primals, logp, ent, lse, entropy, hit_ids = res
    g, h = cts
    row = (RowGrad(g.astype(F32), h.astype(F32), entropy) if with_entropy
           else RowGrad(g.astype(F32)))
    return (grad_fn(primals, hit_ids, lse, row), zero_cotangent(logp), zero_cotangent(ent),
            zero_cotangent(lse), zero_cotangent(entropy), zero_cotangents(hit_ids))


with_softmax_gradient.defvjp(_fwd, _bwd)
