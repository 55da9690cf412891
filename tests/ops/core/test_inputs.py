"""The bucketed draws equal jax.random's, bit for bit, and fall back to it where they could not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_kernels.ops.core import inputs

SHAPES = [(), (1,), (3, 13, 301), (8, 1), (1025,)]


def _equal(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_draws_equal_jax_random(shape):
    key = jax.random.fold_in(jax.random.PRNGKey(3), len(shape))
    for dtype in (jnp.float32, jnp.bfloat16):
        _equal(inputs.normal(key, shape, dtype), jax.random.normal(key, shape, dtype))
    _equal(inputs.uniform(key, shape, jnp.float32, 0.2, 2.0),
           jax.random.uniform(key, shape, jnp.float32, 0.2, 2.0))
    _equal(inputs.randint(key, shape, 1, 14), jax.random.randint(key, shape, 1, 14))
    _equal(inputs.randint(key, shape, 0, 301, jnp.int32),
           jax.random.randint(key, shape, 0, 301, dtype=jnp.int32))


def test_sizes_share_one_sampler():
    """Shapes of 2-1024 values draw at one size; past MAX_BUCKET, at their own."""
    assert {inputs._bucket(jax.random.PRNGKey(0), n) for n in (2, 300, 1024)} == {1024}
    assert inputs._bucket(jax.random.PRNGKey(0), 1025) == 2048
    assert inputs._bucket(jax.random.PRNGKey(0), inputs.MAX_BUCKET + 1) is None


def test_falls_back_where_a_prefix_is_not_the_draw(monkeypatch):
    """Another PRNG implementation, the non-partitionable threefry, a traced key and a draw
    past MAX_BUCKET are drawn at their own shape: the same values as jax.random still."""
    shape = (3, 5)
    rbg = jax.random.key(1, impl="rbg")
    assert inputs._bucket(rbg, 15) is None
    _equal(inputs.normal(rbg, shape), jax.random.normal(rbg, shape))

    traced = jax.jit(lambda k: inputs.normal(k, shape))(jax.random.PRNGKey(2))
    _equal(traced, jax.random.normal(jax.random.PRNGKey(2), shape))

    monkeypatch.setattr(inputs, "MAX_BUCKET", 8)
    key = jax.random.PRNGKey(4)
    _equal(inputs.normal(key, shape), jax.random.normal(key, shape))

    with jax.threefry_partitionable(False):
        assert inputs._bucket(jax.random.PRNGKey(5), 15) is None
