"""What the objective's modules share: the batch-sum and batch-gather hooks, float32, row
counts and the advantages' broadcast."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

Array = jax.Array

BatchSum = Callable[[Array], Array]
"""Maps a sum over this device's part of the batch to the sum over the whole batch.

The identity on one device; ``psum`` over the batch axes inside ``shard_map``
(:mod:`grpo_kernels.sharding`). Every normaliser and every mean below goes through it, so a
sharded loss equals the one-device loss.
"""


BatchGather = Callable[[Array], Array]
"""Maps this device's rows (axis 0) to the whole batch's rows: the identity on one device,
``all_gather`` over the batch axes inside ``shard_map``. Only the batch-wide entropy quantile
(:func:`~grpo_kernels.objective.factors.entropy_mask`) needs it."""


def _local(x: Array) -> Array:
    return x


_sg = jax.lax.stop_gradient


def _f32(x: Any) -> Array:
    return jnp.asarray(x, jnp.float32)


def _row_counts(mask: Array) -> Array:
    """``[B, 1]`` tokens per sequence, :math:`n_b`."""
    return jnp.sum(mask, axis=-1, keepdims=True)


def advantage_columns(advantages: Array) -> Array:
    """Advantages broadcastable against ``[B, T]``: ``[B]`` (one per sequence) as ``[B, 1]``,
    ``[B, T]`` (one per token, as packed rows carry them) as they are; float32."""
    a = _f32(advantages)
    return a[:, None] if a.ndim == 1 else a
