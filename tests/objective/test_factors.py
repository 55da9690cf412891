"""objective.factors against NumPy float64 formulas (TRL's definitions)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_kernels.config import SAMPLER_CORRECTIONS, GRPOLossConfig
from grpo_kernels.objective import factors

MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], np.float64)
RNG = np.random.default_rng(0)
OLD = -np.abs(RNG.normal(size=MASK.shape)) - 1.0
SAMPLER = OLD + 0.3 * RNG.normal(size=MASK.shape)


def _local(x):
    return x


@pytest.mark.parametrize("mode", SAMPLER_CORRECTIONS)
@pytest.mark.parametrize("bounds", [(None, 1.2), (0.8, None), (0.9, 1.1)])
def test_sampler_ratio(mode, bounds):
    low, high = bounds
    cfg = GRPOLossConfig(sampler_correction=mode, sampler_correction_min=low,
                         sampler_correction_max=high)
    got = np.asarray(factors.sampler_ratio(OLD, SAMPLER, MASK, cfg), np.float64)
    d = (OLD - SAMPLER) * MASK
    if mode.startswith("sequence"):
        d = d.sum(-1, keepdims=True)
    rho = np.exp(d)
    lo, hi = -np.inf if low is None else low, np.inf if high is None else high
    want = np.clip(rho, lo, hi) if mode.endswith("truncate") else np.where(
        (rho < lo) | (rho > hi), 0.0, rho)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5)
    if mode.startswith("token"):  # the bounds act on some tokens and not on others
        assert 0 < (want != rho).sum() < want.size


def test_off_policy_mask():
    logp = OLD + 0.2 * RNG.normal(size=MASK.shape)
    adv = np.array([[-1.0], [0.5], [-0.2]])
    kl = ((SAMPLER - logp) * MASK).sum(-1, keepdims=True) / MASK.sum(-1, keepdims=True)
    threshold = float(np.median(kl))
    got = np.asarray(factors.off_policy_mask(logp, SAMPLER, MASK, adv, threshold))
    np.testing.assert_array_equal(got, ((adv >= 0) | (kl <= threshold)).astype(np.float32))


@pytest.mark.parametrize("q", [0.0, 0.2, 0.5, 0.83, 1.0])
def test_masked_quantile_is_numpys_linear_quantile(q):
    values = RNG.normal(size=MASK.shape)
    got, n = factors.masked_quantile(values, MASK, q, _local)
    assert int(n) == MASK.sum()
    np.testing.assert_allclose(float(got), np.quantile(values[MASK > 0], q), rtol=1e-6)
    empty, n0 = factors.masked_quantile(values, np.zeros_like(MASK), q, _local)
    assert int(n0) == 0 and float(empty) == 0.0


def test_entropy_mask_keeps_the_top_fraction_of_masked_tokens():
    ent = np.abs(RNG.normal(size=MASK.shape))
    cfg = GRPOLossConfig(top_entropy_quantile=0.3)
    got = np.asarray(factors.entropy_mask(ent, MASK, cfg, _local))
    threshold = np.quantile(ent[MASK > 0], 0.7)
    np.testing.assert_array_equal(got, ((ent >= threshold) & (MASK > 0)).astype(np.float32))
    assert 0 < got.sum() < MASK.sum()
    assert not np.asarray(factors.entropy_mask(ent, 0 * MASK, cfg, _local)).any()


def test_vespo_weights_against_the_gamma_formula():
    cfg = GRPOLossConfig(loss_type="vespo")
    log_ratio = 0.1 * RNG.normal(size=MASK.shape)
    adv = np.array([[1.0], [-1.0], [0.0]])
    rho = np.exp(0.05 * RNG.normal(size=MASK.shape))
    got = np.asarray(factors.vespo_weights(log_ratio, MASK, adv, cfg, rho), np.float64)
    log_w = (log_ratio * MASK).sum(-1, keepdims=True) + np.log(rho).sum(-1, keepdims=True)
    w = np.exp(log_w)
    k = np.where(adv >= 0, 2.0, 3.0)
    lam = np.where(adv >= 0, 3.0, 2.0)
    want = np.e ** lam * w ** k * np.exp(-lam * w)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert abs(float(factors.vespo_weights(np.zeros((1, 2)), np.ones((1, 2)), np.ones((1, 1)),
                                           cfg)[0, 0]) - 1.0) < 1e-6  # phi(1) = 1


def test_entropy_weights():
    """A token mean over the policy term's tokens, whatever the loss type (TRL 1.16 never
    divides the bonus by ``num_items_in_batch``): weights of the ``selected`` tokens over their
    count, of every real token over the mask's count without a selection."""
    selected = np.array([[1, 0, 1, 1], [0, 1, 1, 0], [1, 1, 0, 1]], np.float64)
    eff = MASK * selected
    assert 0 < eff.sum() < MASK.sum()
    np.testing.assert_allclose(np.asarray(factors.entropy_weights(MASK, _local, selected)),
                               eff / eff.sum(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(factors.entropy_weights(MASK, _local)),
                               MASK / MASK.sum(), rtol=1e-6)
    empty = np.zeros_like(MASK)
    assert not np.asarray(factors.entropy_weights(empty, _local)).any()


def test_factors_carry_no_gradient():
    cfg = GRPOLossConfig(sampler_correction="token_truncate", off_policy_mask_threshold=0.1,
                         top_entropy_quantile=0.5, loss_type="vespo")

    def total(lp, ent):
        a = jnp.ones((3, 1))
        return (jnp.sum(factors.sampler_ratio(lp, SAMPLER, MASK, cfg))
                + jnp.sum(factors.off_policy_mask(lp, SAMPLER, MASK, a, 0.1))
                + jnp.sum(factors.entropy_mask(ent, MASK, cfg, _local))
                + jnp.sum(factors.vespo_weights(lp - OLD, MASK, a, cfg)))

    grads = jax.grad(total, (0, 1))(jnp.asarray(OLD, jnp.float32), jnp.ones(MASK.shape))
    assert all(float(jnp.abs(g).max()) == 0 for g in grads)
