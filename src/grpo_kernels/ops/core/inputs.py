"""What the random inputs of both ops share (tests, gradcheck and bench build them).

The draws (:func:`normal`, :func:`uniform`, :func:`randint`) equal ``jax.random``'s bit for
bit, but each is one compiled program per power-of-two size instead of one per shape: with
JAX's partitionable threefry (its default), element ``i`` of a draw of ``n`` values is a
function of the key and ``i`` alone, so the first ``n`` of a draw of ``N >= n`` values, in
row-major order, are the draw of shape ``[n]`` (and of any shape with ``n`` elements). A grid
of inputs of many shapes then compiles a handful of samplers, where each shape and dtype would
compile a program of its own (tests/README.md measures the difference).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grpo_kernels.config import GRPOLossConfig

# Above this many values a draw is made at its own shape: its program costs what a bucket's
# would, and a power-of-two bucket could hold up to twice its values.
MAX_BUCKET = 1 << 22
MIN_BUCKET = 1 << 10


def _bucket(key: jax.Array, n: int) -> int | None:
    """The power-of-two size at which ``n`` values are drawn from ``key``, or None (drawn as
    they are): where ``n`` is past :data:`MAX_BUCKET` or the draw would not be
    prefix-consistent (the non-partitionable threefry, another PRNG implementation), or
    where ``key`` is traced (the values are cut on the host)."""
    if isinstance(key, jax.core.Tracer) or n > MAX_BUCKET:
        return None
    if not jax.config.jax_threefry_partitionable:
        return None
    if str(jax.random.key_impl(key)) != "threefry2x32":
        return None
    return max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length())


def _draw(key: jax.Array, sample, shape: tuple[int, ...]) -> jax.Array:
    """``sample(shape)``, computed as the first values of ``sample((bucket,))``."""
    shape = tuple(int(d) for d in shape)
    n = math.prod(shape)
    size = _bucket(key, n)
    if size is None:
        return sample(shape)
    # sliced on the host, so that no per-shape slice or reshape is compiled either
    return jnp.asarray(np.asarray(sample((size,)))[:n].reshape(shape))


def normal(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    """``jax.random.normal(key, shape, dtype)``, the same values (module docstring)."""
    return _draw(key, lambda s: jax.random.normal(key, s, dtype), shape)


def uniform(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32,
            minval: float = 0.0, maxval: float = 1.0) -> jax.Array:
    """``jax.random.uniform(key, shape, dtype, minval, maxval)``, the same values (module
    docstring); ``minval`` and ``maxval`` are scalars."""
    return _draw(key, lambda s: jax.random.uniform(key, s, dtype, minval, maxval), shape)


def randint(key: jax.Array, shape: tuple[int, ...], minval: int, maxval: int,
            dtype: Any = int) -> jax.Array:
    """``jax.random.randint(key, shape, minval, maxval, dtype)``, the same values (module
    docstring); ``minval`` and ``maxval`` are scalars."""
    return _draw(key, lambda s: jax.random.randint(key, s, minval, maxval, dtype=dtype), shape)


def wants_sampler_logps(config: GRPOLossConfig) -> bool:
    """Whether random inputs for ``config`` carry sampler log-probs: a sampler correction
    needs them, the off-policy mask reads them when given."""
    return config.needs_sampler_logps or config.off_policy_mask_threshold is not None


def sampler_logps_near(key: jax.Array, logps: jax.Array, noise: float) -> jax.Array:
    """A sampler's log-probs: ``logps`` plus ``N(0, noise^2)`` (vLLM and the trainer disagree
    a little on every token)."""
    return logps + noise * normal(key, logps.shape)
