"""core.vjp: the one custom_vjp builder of the fast backends."""

import jax
import jax.numpy as jnp
import numpy as np

from grpo_kernels.objective.batch import TokenBatch
from grpo_kernels.ops.core.vjp import loss_with_gradient, zero_cotangent


def _batch():
    return TokenBatch(ids=jnp.array([[1, 2]], jnp.int32), mask=jnp.ones((1, 2)),
                      advantages=jnp.array([0.5]))


def _toy(x, w, batch):  # loss = sum(mask * x) * <w, w> * A
    return jnp.sum(batch.mask * x) * jnp.sum(w * w) * batch.advantages[0]


def _forward(primals, batch, with_grad):
    x, w = primals
    loss = _toy(x, w, batch)
    grads = jax.grad(_toy, argnums=(0, 1))(x, w, batch) if with_grad else None
    return (loss, {"m": loss + 1}), grads


def test_gradient_formed_in_the_forward_is_scaled_by_the_cotangent():
    x = jnp.array([[0.3, -1.2]]); w = jnp.array([1.5, -0.5, 2.0])
    fn = loss_with_gradient(_forward)

    def outer(x, w):
        loss, metrics = fn((x, w), _batch())
        return 3.0 * loss, metrics

    (val, metrics), got = jax.value_and_grad(outer, argnums=(0, 1), has_aux=True)(x, w)
    want = jax.grad(lambda x, w: 3.0 * _toy(x, w, _batch()), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(val, 3.0 * _toy(x, w, _batch()), rtol=1e-6)
    np.testing.assert_allclose(metrics["m"], _toy(x, w, _batch()) + 1, rtol=1e-6)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_the_batch_gets_zero_cotangents():
    x = jnp.array([[0.3, -1.2]]); w = jnp.array([1.5])
    fn = loss_with_gradient(_forward)
    g = jax.grad(lambda b: fn((x, w), b)[0], allow_int=True)(_batch())
    assert g.ids.dtype == jax.dtypes.float0
    assert float(jnp.abs(g.mask).max()) == 0 and float(jnp.abs(g.advantages).max()) == 0
    assert zero_cotangent(None) is None
