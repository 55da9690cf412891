"""The LM head as every implementation of the fused op sees it: layouts, dtypes, matmuls."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from grpo_kernels.ops.core.dtypes import F32, common_dtype

Array = jax.Array
LAYOUTS: tuple[str, ...] = ("hv", "vh")


@dataclasses.dataclass(frozen=True)
class HeadFormat:
    """Static facts of a head call: the weights' layout (``"hv"``: ``[H, V]``; ``"vh"``:
    ``[V, H]``), the dtype of the logits the loss sees (resolved, never ``None``) and their soft
    cap (``None``: none; :func:`~grpo_kernels.ops.core.online_softmax.soft_cap`)."""

    layout: str
    logits_dtype: jnp.dtype
    softcap: float | None = None

    def vocab(self, w: Any) -> int:
        """``V`` of head weights ``w`` in this layout."""
        return w.shape[1] if self.layout == "hv" else w.shape[0]


def delta_dtype(logits_dtype: Any, operand_dtype: Any) -> jnp.dtype:
    """The dtype of ``delta``, the logits' gradient that the two gradient matmuls take: the
    narrower of the logits dtype and the matmul operands' dtype.

    An f32 head on 16-bit operands (``logits_dtype=float32``) keeps its logits and statistics
    in float32 but multiplies a 16-bit ``delta`` by the 16-bit ``W`` (float32 accumulation), as
    mixed-precision training does. A float32 ``delta`` would upcast ``W`` every chunk and run
    both matmuls at float32 speed (docs/lm_head.md has the measurement).
    """
    logits, operands = jnp.dtype(logits_dtype), jnp.dtype(operand_dtype)
    return logits if logits.itemsize <= operands.itemsize else operands


def matmul(a: Array, b: Array, dims: Any) -> Array:
    """``dot_general`` with float32 accumulation, operands in their :func:`common_dtype`."""
    dtype = common_dtype(a.dtype, b.dtype)
    return jax.lax.dot_general(a.astype(dtype), b.astype(dtype), (dims, ((), ())),
                               preferred_element_type=F32)


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
