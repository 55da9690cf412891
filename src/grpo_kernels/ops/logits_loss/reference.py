"""Reference GRPO loss on logits: plain jnp with a float32 ``log_softmax``; the ground truth."""

from __future__ import annotations

import jax

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective.batch import TokenBatch
from grpo_kernels.ops.core.reference import token_logp_and_entropy

Array = jax.Array


def reference_grpo_loss(logits: Array, batch: TokenBatch, config: GRPOLossConfig,
                        options: None = None,
                        softcap: float | None = None) -> tuple[Array, dict[str, Array]]:
    """GRPO loss with materialised float32 log-softmax; differentiable by plain autodiff.

    Args, returns: as :func:`grpo_kernels.grpo_loss` (``options`` must be ``None``;
    ``softcap``: its ``logit_softcap``).
    """
    del options
    logp, entropy = token_logp_and_entropy(logits, batch.ids, config.temperature, softcap)
    loss, metrics, _ = batch.loss(logp, entropy, config, with_grad=False)  # autodiff from here
    return loss, metrics
