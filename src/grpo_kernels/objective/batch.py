"""``TokenBatch``: the per-call inputs of the loss besides its logits (or hidden states and
head) and its config: one pytree that every backend takes and the objective reads."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective.base import BatchGather, BatchSum, advantage_columns
from grpo_kernels.objective.gradient import RowGrad, entropy_bonus_grad, loss_from_token_stats
from grpo_kernels.objective.segments import Segments
from grpo_kernels.objective.weights import token_weights

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenBatch:
    """What the loss needs besides the logits (or hidden states and head) and the config.

    Every fast backend takes it whole and gives it zero cotangents
    (:mod:`grpo_kernels.ops.core.vjp`); the objective's functions read it
    (:func:`~grpo_kernels.objective.grpo_objective`); the sharding
    layer splits it over the batch axes.

    Attributes:
      ids: ``[B, T]`` chosen token ids (already checked; clamped by each backend).
      mask: ``[B, T]`` completion mask.
      advantages: ``[B]``, or ``[B, T]`` (per token, as packed rows carry them).
      old_logps: ``[B, T]`` sampling-policy log-probs, or ``None`` (on-policy).
      ref_logps: ``[B, T]`` reference log-probs, or ``None``.
      num_items: The ``dapo`` normaliser as a float32 scalar, or ``None``.
      sampler_weights: ``[B, T]`` weights of each token's policy term, or ``None``.
      sampler_logps: ``[B, T]`` log-probs of the sampler (for ``sampler_correction`` and the
        off-policy mask), or ``None``.
      segments: The segment layout of packed rows
        (:class:`~grpo_kernels.objective.segments.Segments`), or ``None``.
    """

    ids: Array
    mask: Array
    advantages: Array
    old_logps: Array | None = None
    ref_logps: Array | None = None
    num_items: Array | None = None
    sampler_weights: Array | None = None
    sampler_logps: Array | None = None
    segments: Segments | None = None

    @classmethod
    def of(cls, ids: Array, mask: Array, advantages: Array, old_logps: Array | None = None,
           ref_logps: Array | None = None, num_items_in_batch: Array | float | None = None,
           sampler_weights: Array | None = None, sampler_logps: Array | None = None,
           segments: Segments | None = None) -> "TokenBatch":
        """The batch of a public call's arguments (``num_items_in_batch`` made float32)."""
        num_items = (None if num_items_in_batch is None
                     else jnp.asarray(num_items_in_batch, jnp.float32))
        return cls(ids, mask, advantages, old_logps, ref_logps, num_items, sampler_weights,
                   sampler_logps, segments)

    @property
    def shape(self) -> tuple[int, int]:
        """``(B, T)``."""
        return tuple(self.ids.shape)

    def clamped_ids(self, vocab: int) -> Array:
        """``ids`` as int32 clamped into ``[0, vocab)`` (the documented rule for bad ids)."""
        return jnp.clip(self.ids.astype(jnp.int32), 0, vocab - 1)

    def loss(self, logp: Array, entropy: Array, config: GRPOLossConfig, with_grad: bool,
             batch_sum: BatchSum | None = None, batch_gather: BatchGather | None = None,
             ) -> tuple[Array, dict[str, Array], RowGrad | None]:
        """``(loss, metrics, grad)`` of the ``[B, T]`` log-probs and entropies an
        implementation computed (:func:`grpo_kernels.objective.loss_from_token_stats` on this
        batch); ``batch_sum`` and ``batch_gather`` make this device's rows part of a sharded
        batch."""
        extra = {} if batch_sum is None else {"batch_sum": batch_sum}
        if batch_gather is not None:
            extra["batch_gather"] = batch_gather
        return loss_from_token_stats(logp, entropy, self, config, with_grad=with_grad, **extra)

    def token_columns(self, config: GRPOLossConfig, batch_sum: BatchSum | None = None,
                      ) -> dict[str, Array | None]:
        """The per-token inputs of :func:`grpo_kernels.objective.token_row_grad`, each ``[N]``
        float32 (``N = B*T``, row-major) or ``None``: the loss weights
        (:func:`~grpo_kernels.objective.token_weights`), the advantages broadcast over time,
        the old, reference and sampler log-probs, the sampler weights, the mask and the entropy
        bonus's ``h`` (known from the mask). For a token-separable config these are all a
        token's gradient needs besides its own log-prob. ``batch_sum`` makes the weights'
        normalisers the whole sharded batch's (as in :meth:`loss`)."""
        b, t = self.shape
        extra = {} if batch_sum is None else {"batch_sum": batch_sum}

        def flat(x: Array | None) -> Array | None:
            return None if x is None else x.reshape(-1).astype(jnp.float32)

        return {
            "weights": flat(token_weights(self.mask, config, self.num_items,
                                          segments=self.segments, **extra)),
            "advantages": flat(jnp.broadcast_to(advantage_columns(self.advantages), (b, t))),
            "old_logp": flat(self.old_logps), "ref_logp": flat(self.ref_logps),
            "sampler_weights": flat(self.sampler_weights), "mask": flat(self.mask),
            "sampler_logps": flat(self.sampler_logps),
            "h": flat(entropy_bonus_grad(self.mask, config, **extra)),
        }
