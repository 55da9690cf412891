"""Reference GRPO loss on logits: plain jnp with a float32 ``log_softmax``; the ground truth."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective import grpo_objective, loss_metrics

Array = jax.Array


def token_logp_and_entropy(logits: Array, ids: Array, temperature: float) -> tuple[Array, Array]:
    """Chosen-token log-probs and entropies of ``softmax(logits / temperature)`` in float32.

    Ids outside ``[0, V)`` are clamped into range (see ``docs/loss.md``).
    """
    vocab = logits.shape[-1]
    scaled = logits.astype(jnp.float32) / temperature
    logsm = jax.nn.log_softmax(scaled, axis=-1)
    ids = jnp.clip(ids.astype(jnp.int32), 0, vocab - 1)
    logp = jnp.take_along_axis(logsm, ids[..., None], axis=-1)[..., 0]
    sg_logsm = jax.lax.stop_gradient(logsm)
    p = jnp.exp(sg_logsm)
    entropy = -jnp.sum(jnp.where(p > 0, p * sg_logsm, 0.0), axis=-1)
    return logp, entropy


def reference_grpo_loss(
    logits: Array,
    ids: Array,
    mask: Array,
    advantages: Array,
    *,
    config: GRPOLossConfig,
    old_logps: Array | None = None,
    ref_logps: Array | None = None,
    num_items_in_batch: Array | float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """GRPO loss with materialised float32 log-softmax; differentiable by plain autodiff.

    Args, returns: as :func:`grpo_kernels.grpo_loss`.
    """
    logp, entropy = token_logp_and_entropy(logits, ids, config.temperature)
    loss, aux = grpo_objective(
        logp, mask, advantages, config, old_logps, ref_logps, num_items_in_batch
    )
    return loss, loss_metrics(logp, entropy, aux, mask, advantages, config)
