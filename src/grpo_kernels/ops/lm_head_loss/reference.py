"""Reference LM-head GRPO loss: materialised ``[B, T, V]`` logits, then the reference loss.

This is the baseline users have today: ``logits = hidden @ W + b`` in full, then a float32
``log_softmax``. Plain autodiff differentiates it.
"""

from __future__ import annotations

import jax

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective.batch import TokenBatch
from grpo_kernels.ops.core.reference import truncated_token_logps
from grpo_kernels.ops.core.truncation import config_truncation, outside_count
from grpo_kernels.ops.lm_head_loss.head import HeadFormat, head_logits

Array = jax.Array


def reference_lm_head_loss(hidden: Array, lm_head: Array, bias: Array | None,
                           batch: TokenBatch, config: GRPOLossConfig, fmt: HeadFormat,
                           options: None = None) -> tuple[Array, dict[str, Array]]:
    """GRPO loss of :func:`head_logits` with float32 statistics; plain autodiff."""
    del options
    logits = head_logits(hidden, lm_head, fmt.layout, bias, fmt.logits_dtype)
    trunc = config_truncation(config, logits.shape[-1])
    logp, entropy, outside = truncated_token_logps(logits, batch.ids, config.temperature,
                                                   fmt.softcap, trunc)
    loss, metrics, _ = batch.loss(logp, entropy, config, with_grad=False)
    if outside is not None:
        metrics["outside_truncation"] = outside_count(outside, batch.mask)
    return loss, metrics
