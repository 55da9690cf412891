r"""Softmax statistics of a vocabulary split over devices, and the gradient that goes with them.

Device ``k`` of the vocab axis holds the columns :math:`V_k` of every row. With
:math:`s = z / \tau`, it computes over its own columns only (with the chosen implementation):

.. math::

    \mathrm{lse}_k = \log \sum_{v \in V_k} e^{s_v}, \qquad
    H_k = \text{entropy of } \mathrm{softmax}(s|_{V_k}), \qquad
    \log\pi_k = s_y - \mathrm{lse}_k \ \ (\text{used only where } y \in V_k).

The whole-row statistics follow from ``[B, T]``-sized collectives (a ``pmax`` and three
``psum``, nothing vocabulary-sized):

.. math::

    \mathrm{lse} &= M + \log \sum_k e^{\mathrm{lse}_k - M}, \quad M = \max_k \mathrm{lse}_k \\
    \log\pi(y) &= \log\pi_{k^*} + (\mathrm{lse}_{k^*} - \mathrm{lse})
      \quad (k^* \text{ owns } y) \\
    H &= \sum_k w_k \,(H_k + \mathrm{lse} - \mathrm{lse}_k), \quad w_k = e^{\mathrm{lse}_k - \mathrm{lse}}

(the last since :math:`p_v = w_k\,p^{(k)}_v` on :math:`V_k`). The gradient of the loss w.r.t.
the local logits is the one-device formula with the *global* ``lse``:

.. math::

    \frac{\partial L}{\partial z_v} = \frac{g}{\tau}\,(\mathbb{1}[v = y] - e^{s_v - \mathrm{lse}}),
    \quad v \in V_k,

so every implementation's gradient kernel serves unchanged, given ``lse`` and ids of ``-1`` on the
shards that do not own ``y`` (no column matches).
:func:`grpo_kernels.ops.core.vjp.with_softmax_gradient` attaches it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective.batch import TokenBatch
from grpo_kernels.sharding.spec import ShardingSpec

Array = jax.Array
_F32 = jnp.float32
_sg = jax.lax.stop_gradient


def split_ids(ids: Array, vocab: int, vocab_local: int,
              spec: ShardingSpec) -> tuple[Array, Array, Array]:
    """``(owned, stat_ids, hit_ids)`` for this device's vocabulary shard.

    Ids are first clamped into ``[0, V)`` (the one-device rule). ``owned``: the id falls in
    this shard; ``stat_ids``: the local id clamped into ``[0, V_k)`` (for kernels that need an
    in-range id); ``hit_ids``: the local id, or ``-1`` where not owned (matches no column).
    """
    ids = jnp.clip(ids.astype(jnp.int32), 0, vocab - 1)
    local = ids - spec.vocab_offset(vocab_local)
    owned = (local >= 0) & (local < vocab_local)
    return owned, jnp.where(owned, local, 0), jnp.where(owned, local, -1)


def combine(logp_k: Array, lse_k: Array, ent_k: Array, owned: Array,
            spec: ShardingSpec) -> tuple[Array, Array, Array, Array]:
    r"""``(part, ent_part, lse, entropy)`` from each shard's statistics (see the module
    docstring).

    ``lse`` and the entropy are whole-row values; ``part`` is this shard's share of
    :math:`\log\pi(y)` (the owner's term, zero elsewhere): ``vocab_sum(part)`` is the log-prob;
    ``ent_part`` likewise of the entropy (:math:`w_k (H_k + \mathrm{lse} - \mathrm{lse}_k)`).
    They are left unsummed so that their gradients can be attached per shard
    (:func:`with_softmax_gradient`) before the sum, whose transpose JAX then handles.
    """
    if spec.vocab_axis is None:
        return logp_k, ent_k, lse_k, ent_k
    m = spec.vocab_max(lse_k)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = m + jnp.log(spec.vocab_sum(jnp.exp(lse_k - m)))
    part = jnp.where(owned, logp_k + (lse_k - lse), 0.0)
    w = jnp.exp(lse_k - lse)
    ent_part = jnp.where(w > 0, w * (ent_k + (lse - lse_k)), 0.0)
    return part, ent_part, lse, spec.vocab_sum(ent_part)


def reference_statistics(z: Array, hit_ids: Array, temperature: float,
                         spec: ShardingSpec) -> tuple[Array, Array]:
    """``(logp, entropy)`` of the local logits ``[..., V_k]`` in plain ``jnp``.

    Differentiable by autodiff through the collectives (the ``pmax`` shift is a constant), so
    it checks the custom gradients of the fast paths independently.
    """
    s = z.astype(_F32) / temperature
    m = spec.vocab_max(_sg(jnp.max(s, axis=-1)))
    e = jnp.exp(s - m[..., None])
    total = spec.vocab_sum(jnp.sum(e, axis=-1))
    lse = m + jnp.log(total)
    hit = jax.lax.broadcasted_iota(jnp.int32, s.shape, s.ndim - 1) == hit_ids[..., None]
    chosen = spec.vocab_sum(jnp.sum(jnp.where(hit, s, 0.0), axis=-1))
    p = e / total[..., None]
    # Differentiable (the entropy bonus needs its gradient); where p = 0 the log is replaced
    # by 0 before the product, so no 0 * inf enters the backward.
    shifted = jnp.where(_sg(p) > 0, s - lse[..., None], 0.0)
    ent = -spec.vocab_sum(jnp.sum(p * shifted, axis=-1))
    return chosen - lse, ent


def loss_and_metrics(logp: Array, entropy: Array, batch: TokenBatch, config: GRPOLossConfig,
                     spec: ShardingSpec) -> tuple[Array, dict[str, Array]]:
    """The GRPO objective and metrics on this device's rows, normalised over the whole batch."""
    loss, metrics, _ = batch.loss(logp, entropy, config, with_grad=False,
                                  batch_sum=spec.batch_sum, batch_gather=spec.batch_gather)
    return loss, metrics
