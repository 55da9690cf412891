"""objective: the per-token weights, the KL estimator and the per-token gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective import (
    grpo_objective,
    kl_k3,
    masked_mean,
    token_loss_grad,
    token_separable,
    token_weights,
)

MASK = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], jnp.float32)


@pytest.mark.parametrize("loss_type,want_row0", [
    ("grpo", 1 / (3 * 3)), ("bnpo", 1 / 4), ("dr_grpo", 1 / (3 * 4)), ("dapo", 1 / 4)])
def test_token_weights(loss_type, want_row0):
    cfg = GRPOLossConfig(loss_type=loss_type, max_completion_length=4)
    w = np.asarray(token_weights(MASK, cfg))
    np.testing.assert_allclose(w[0, :3], want_row0, rtol=1e-6)
    assert (w[MASK == 0] == 0).all()
    np.testing.assert_allclose(np.asarray(token_weights(MASK, GRPOLossConfig(loss_type="dapo"),
                                                        num_items_in_batch=8.0))[0, 0], 1 / 8)


def test_kl_k3_is_zero_at_equality_and_positive_elsewhere():
    lp = jnp.array([-1.0, -2.0, -0.1])
    assert float(jnp.abs(kl_k3(lp, lp)).max()) == 0
    assert bool((kl_k3(lp, lp + jnp.array([0.3, -0.5, 1.0])) > 0).all())


def test_masked_mean_of_an_empty_mask_is_zero():
    assert float(masked_mean(jnp.ones((2, 3)), jnp.zeros((2, 3)))) == 0


@pytest.mark.parametrize("beta,delta", [(0.0, None), (0.04, 1.5)])
def test_token_loss_grad_equals_autodiff_of_the_objective(beta, delta):
    cfg = GRPOLossConfig(beta=beta, delta=delta, loss_type="bnpo", epsilon_high=0.28)
    k = jax.random.split(jax.random.PRNGKey(3), 4)
    logp = -jnp.abs(jax.random.normal(k[0], MASK.shape))
    old = logp + 0.3 * jax.random.normal(k[1], MASK.shape)
    ref = logp + 0.1 * jax.random.normal(k[2], MASK.shape)
    adv = jax.random.normal(k[3], (MASK.shape[0],))
    want = jax.grad(lambda lp: grpo_objective(lp, MASK, adv, cfg, old, ref)[0])(logp)
    got = token_loss_grad(logp, token_weights(MASK, cfg), adv[:, None], cfg, old, ref)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)
    assert float(jnp.abs(want).max()) > 0


def test_sequence_level_is_not_token_separable():
    cfg = GRPOLossConfig(importance_sampling_level="sequence")
    assert not token_separable(cfg)
    with pytest.raises(ValueError, match="importance_sampling_level='token'"):
        token_loss_grad(jnp.zeros(3), jnp.ones(3), jnp.ones(3), cfg)
