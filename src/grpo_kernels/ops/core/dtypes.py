"""Dtype names and casts shared by every implementation."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from grpo_kernels.ops.core.platform import by_platform

Array = jax.Array
F32 = jnp.float32

# The spellings every command accepts for ``--dtype`` (and ``parse_dtype``).
DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
                          "f32": jnp.float32, "bf16": jnp.bfloat16}
DTYPE_CHOICES: tuple[str, ...] = tuple(DTYPES)


def parse_dtype(name: str) -> Any:
    """``"bf16"``/``"bfloat16"``/``"f32"``/``"float32"`` -> jnp dtype; ValueError otherwise."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def dtype_name(name: str) -> str:
    """The canonical name (``"bfloat16"``, ``"float32"``) of any accepted spelling."""
    return jnp.dtype(parse_dtype(name)).name


def to_bfloat16(x: Array) -> Array:
    """float32 -> bfloat16 with round-to-nearest-even, written as integer arithmetic.

    Bit-identical to ``x.astype(jnp.bfloat16)`` for finite values and infinities; NaNs map to
    the quiet NaN ``0x7FC0``. XLA:CPU lowers a float32 -> bfloat16 ``convert`` to slow scalar
    code; these integer ops vectorise inside the surrounding fusion (docs/xla.md has the
    measurement).
    """
    bits = jax.lax.bitcast_convert_type(x.astype(F32), jnp.uint32)
    rounded = (bits + (jnp.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16
    rounded = jnp.where(jnp.isnan(x), jnp.uint32(0x7FC0), rounded)
    return jax.lax.bitcast_convert_type(rounded.astype(jnp.uint16), jnp.bfloat16)


def cast_to(x: Array, dtype: Any) -> Array:
    """``x.astype(dtype)``, through :func:`to_bfloat16` for bfloat16 on CPU.

    The choice is made when the program is lowered, for the platform it is lowered for
    (:func:`~grpo_kernels.ops.core.platform.by_platform`), not by the tracing host's backend:
    a TPU or GPU program traced on a CPU host (``jax.export``, a compile for a TPU topology)
    keeps the plain ``convert``, which XLA folds into the ops around it, and never the integer
    rounding.
    """
    if jnp.dtype(dtype) != jnp.bfloat16 or x.dtype == jnp.bfloat16:
        return x.astype(dtype)
    return by_platform(lambda on_cpu, v: to_bfloat16(v) if on_cpu else v.astype(jnp.bfloat16),
                       lambda kind: kind == "cpu", x)


def common_dtype(a: Any, b: Any) -> jnp.dtype:
    """The dtype two matmul operands are brought to: theirs if equal, else float32."""
    a, b = jnp.dtype(a), jnp.dtype(b)
    return a if a == b else jnp.dtype(F32)


def as_f32(x: Array | None) -> Array | None:
    """``x`` as float32 (``None`` stays ``None``)."""
    return None if x is None else jnp.asarray(x, F32)
