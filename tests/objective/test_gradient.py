"""objective.gradient: dL/dlogp and dL/dH as the fast implementations consume them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective import (
    TokenBatch,
    entropy_bonus_grad,
    loss_from_token_stats,
    token_loss_grad,
    token_separable,
    token_weights,
)
from grpo_kernels.objective.factors import vespo_weights
from tests.helpers import family_grid, family_id, objective

MASK = jnp.array([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], jnp.float32)


def _inputs(seed):
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    logp = -jnp.abs(jax.random.normal(k[0], MASK.shape)) - 0.5
    old = logp + 0.3 * jax.random.normal(k[1], MASK.shape)
    ref = logp + 0.1 * jax.random.normal(k[2], MASK.shape)
    sampler = old + 0.1 * jax.random.normal(k[3], MASK.shape)
    ent = jnp.abs(jax.random.normal(k[4], MASK.shape)) + 0.5
    adv = jax.random.normal(k[5], (MASK.shape[0],))
    return logp, old, ref, sampler, ent, adv


FAMILY = family_grid(MASK.shape[1])
SEPARABLE = [c for c in FAMILY if token_separable(c)]


def test_which_options_are_token_separable():
    names = {family_id(c) for c in SEPARABLE}
    assert all(c.importance_sampling_level == "token" for c in SEPARABLE)
    assert {c.loss_type for c in SEPARABLE} >= {"cispo", "sapo", "luspo"}
    for c in FAMILY:
        if (c.loss_type == "vespo" or c.off_policy_mask_threshold is not None
                or c.top_entropy_quantile < 1 or (c.sampler_correction or "").startswith("seq")):
            assert family_id(c) not in names


@pytest.mark.parametrize("cfg", SEPARABLE, ids=family_id)
def test_token_loss_grad_and_entropy_grad_equal_autodiff(cfg):
    """The fused head's one-pass gradient (a chunk's g from its own tokens, h from the mask)
    equals autodiff of the whole objective, in any chunking."""
    logp, old, ref, sampler, ent, adv = _inputs(1)
    want_g, want_h = jax.grad(
        lambda lp, e: objective(lp, MASK, adv, cfg, old, ref, entropy=e,
                                     sampler_logps=sampler)[0], (0, 1))(logp, ent)
    w = token_weights(MASK, cfg)
    a = jnp.broadcast_to(adv[:, None], MASK.shape)
    names = ("weights", "advantages", "old_logp", "ref_logp", "mask", "sampler_logps")
    flat = dict(zip(names, (x.reshape(-1) for x in (w, a, old, ref, MASK, sampler))))
    parts = [token_loss_grad(logp.reshape(-1)[s:s + 4], {k: x[s:s + 4] for k, x in flat.items()},
                             cfg) for s in range(0, logp.size, 4)]
    np.testing.assert_allclose(jnp.concatenate(parts).reshape(MASK.shape), want_g, rtol=1e-5,
                               atol=1e-8)
    h = entropy_bonus_grad(MASK, cfg)
    if cfg.entropy_coef == 0:
        assert h is None and float(jnp.abs(want_h).max()) == 0
    else:
        np.testing.assert_allclose(h, want_h, rtol=1e-6, atol=1e-9)
        assert float(jnp.abs(want_h).max()) > 0


def test_detached_weights_of_cispo_and_vespo():
    """CISPO and VESPO differentiate their log-prob only: g = -w c A with c the capped ratio
    (CISPO) or VESPO's phi, held constant (TRL detaches both)."""
    logp, old, _, _, _, adv = _inputs(2)
    a = np.asarray(adv, np.float64)[:, None]
    for cfg in (GRPOLossConfig(loss_type="cispo", epsilon_high=1.1),
                GRPOLossConfig(loss_type="vespo")):
        g = jax.grad(lambda lp: objective(lp, MASK, adv, cfg, old)[0])(logp)
        w = np.asarray(token_weights(MASK, cfg), np.float64)
        if cfg.loss_type == "cispo":
            c = np.minimum(np.exp(np.asarray(logp - old, np.float64)), 1.1)
            assert (c == 1.1).any() and (c < 1.1).any()
        else:
            c = np.asarray(vespo_weights(logp - old, MASK, adv[:, None], cfg), np.float64)
        np.testing.assert_allclose(np.asarray(g, np.float64), -w * c * a, rtol=1e-5, atol=1e-9)


def test_row_grad_has_an_entropy_term_only_with_a_coefficient():
    logp, old, _, _, ent, adv = _inputs(3)
    for coef in (0.0, 0.1):
        cfg = GRPOLossConfig(entropy_coef=coef)
        batch = TokenBatch.of(jnp.zeros(MASK.shape, jnp.int32), MASK, adv, old)
        _, _, row = loss_from_token_stats(logp, ent, batch, cfg)
        assert (row.h is None) == (coef == 0) and (row.entropy is None) == (coef == 0)
        scaled = row.scaled(2.0)
        np.testing.assert_allclose(scaled.g, 2 * row.g)
        if coef:
            np.testing.assert_allclose(scaled.h, 2 * row.h)
            np.testing.assert_array_equal(scaled.entropy, row.entropy)
