"""Reference GRPO loss on logits: plain jnp with a float32 ``log_softmax``; the ground truth."""

from __future__ import annotations

import jax

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective.batch import TokenBatch
from grpo_kernels.ops.core.reference import truncated_token_logps
from grpo_kernels.ops.core.truncation import config_truncation, outside_count

Array = jax.Array


def reference_grpo_loss(logits: Array, batch: TokenBatch, config: GRPOLossConfig,
                        options: None = None,
                        softcap: float | None = None) -> tuple[Array, dict[str, Array]]:
    """GRPO loss with materialised float32 log-softmax; differentiable by plain autodiff.

    Args, returns: as :func:`grpo_kernels.grpo_loss` (``options`` must be ``None``;
    ``softcap``: its ``logit_softcap``).
    """
    del options
    trunc = config_truncation(config, logits.shape[-1])
    logp, entropy, outside = truncated_token_logps(logits, batch.ids, config.temperature,
                                                   softcap, trunc)
    loss, metrics, _ = batch.loss(logp, entropy, config, with_grad=False)  # autodiff from here
    if outside is not None:
        metrics["outside_truncation"] = outside_count(outside, batch.mask)
    return loss, metrics
