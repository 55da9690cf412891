"""Reference LM-head GRPO loss: materialised ``[B, T, V]`` logits, then the core reference loss.

This is the baseline users have today: ``logits = hidden @ W + b`` in full, then a float32
``log_softmax``. Plain autodiff differentiates it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.ops.lm_head_loss.xla import common_dtype
from grpo_kernels.ops.logits_loss.reference import reference_grpo_loss

Array = jax.Array


def head_logits(hidden: Array, lm_head: Array, layout: str, bias: Array | None,
                logits_dtype: Any) -> Array:
    """``cast(hidden @ W + b)`` as ``[B, T, V]``: float32 accumulation, one rounding."""
    spec = "bth,hv->btv" if layout == "hv" else "bth,vh->btv"
    dtype = common_dtype(hidden.dtype, lm_head.dtype)
    z = jnp.einsum(spec, hidden.astype(dtype), lm_head.astype(dtype),
                   preferred_element_type=jnp.float32)
    if bias is not None:
        z = z + bias.astype(jnp.float32)[None, None, :]
    return z.astype(logits_dtype)


def reference_lm_head_loss(
    hidden: Array,
    lm_head: Array,
    ids: Array,
    mask: Array,
    advantages: Array,
    *,
    config: GRPOLossConfig,
    old_logps: Array | None = None,
    ref_logps: Array | None = None,
    num_items_in_batch: Array | None = None,
    lm_head_layout: str = "hv",
    bias: Array | None = None,
    logits_dtype: Any = None,
) -> tuple[Array, dict[str, Array]]:
    """GRPO loss of ``head_logits(...)`` by the core reference; args as the fused op."""
    logits_dtype = logits_dtype or common_dtype(hidden.dtype, lm_head.dtype)
    logits = head_logits(hidden, lm_head, lm_head_layout, bias, logits_dtype)
    return reference_grpo_loss(logits, ids, mask, advantages, config=config,
                               old_logps=old_logps, ref_logps=ref_logps,
                               num_items_in_batch=num_items_in_batch)
