"""The reference against the float64 NumPy oracle: values, metrics and gradients."""

import jax.numpy as jnp
import numpy as np
import pytest

from grpo_kernels import GRPOLossConfig
from grpo_kernels.ops.logits_loss.inputs import random_inputs, to_numpy
from tests.helpers import (as64, family_grid, family_id, grid_id, loss_grid, option_grid,
                           option_id, value_and_grad)
from tests.oracle import oracle

B, T, V = 3, 9, 97
GRID = list(loss_grid(T))


def _oracle(inp, cfg, logits=None, **kw):
    logits = as64(inp.logits) if logits is None else logits  # float64 perturbations stay exact
    return oracle(logits, np.asarray(inp.ids), as64(inp.mask), as64(inp.advantages),
                  cfg, to_numpy(inp.old_logps), to_numpy(inp.ref_logps),
                  sampler=to_numpy(inp.sampler_weights),
                  sampler_logps=to_numpy(inp.sampler_logps), **kw)


OPTIONS = option_grid(T)


@pytest.mark.parametrize("cfg", GRID, ids=grid_id)
def test_reference_matches_float64_oracle(cfg):
    inp = random_inputs(1, B, T, V, jnp.float32, cfg, noise=0.3)
    loss, metrics, _ = value_and_grad("reference", inp, cfg, jit=False)
    want, want_m = _oracle(inp, cfg)
    assert np.isfinite(float(loss))
    np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(as64(metrics["logp"]), want_m["logp"], rtol=1e-5, atol=1e-5)
    for key in ("entropy", "kl", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region"):
        np.testing.assert_allclose(float(metrics[key]), want_m[key], rtol=1e-5, atol=1e-6,
                                   err_msg=key)


@pytest.mark.parametrize("cfg,sampler", OPTIONS, ids=[option_id(o) for o in OPTIONS])
def test_options_match_float64_oracle(cfg, sampler):
    """tunix's options (aggregations, KL estimators and clamp, dual clip, log-ratio clamps,
    sampler weights): value, metrics and the two parts of the loss."""
    inp = random_inputs(6, B, T, V, jnp.float32, cfg, noise=0.3, sampler_weights=sampler)
    loss, metrics, _ = value_and_grad("reference", inp, cfg, jit=False)
    want, want_m = _oracle(inp, cfg)
    np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-6)
    for key in ("kl", "clip_ratio_region", "policy_loss", "kl_loss"):
        np.testing.assert_allclose(float(metrics[key]), want_m[key], rtol=1e-5, atol=1e-6,
                                   err_msg=key)
    np.testing.assert_allclose(float(metrics["policy_loss"]) + cfg.beta * float(
        metrics["kl_loss"]), float(loss), rtol=1e-6)


VALUED = [o for o in OPTIONS if o[0].importance_sampling_level != "sequence_token"]


@pytest.mark.parametrize("cfg,sampler", VALUED, ids=[option_id(o) for o in VALUED])
def test_options_gradient_matches_oracle_finite_differences(cfg, sampler):
    """The gradients of those options (GSPO-token has none of its value: it is tested against
    its formula in tests/test_objective.py)."""
    inp = random_inputs(7, 2, 5, 31, jnp.float32, cfg, noise=0.3, sampler_weights=sampler)
    assert_gradient_matches_finite_differences(inp, cfg, seed=1, directions=2)


def test_clip_metrics_are_exercised():
    """With large noise the ratios leave the clip range, so the clip metrics are non-trivial."""
    cfg = GRPOLossConfig()
    inp = random_inputs(2, 4, 16, 50, jnp.float32, cfg, noise=1.0)
    _, metrics, _ = value_and_grad("reference", inp, cfg, jit=False)
    assert 0 < float(metrics["clip_ratio_region"]) < 1
    assert float(metrics["clip_ratio_region"]) == pytest.approx(
        float(metrics["clip_ratio_low"]) + float(metrics["clip_ratio_high"]))


@pytest.mark.parametrize("cfg", GRID[::5], ids=grid_id)
def test_reference_gradient_matches_oracle_finite_differences(cfg):
    """Directional derivatives of the float64 oracle (central differences) vs the f32 gradient."""
    inp = random_inputs(3, 2, 5, 31, jnp.float32, cfg, noise=0.3)
    assert_gradient_matches_finite_differences(inp, cfg, seed=0, directions=3)


def assert_gradient_matches_finite_differences(inp, cfg, seed, directions, h=1e-5):
    """Directional derivatives of the float64 oracle (central differences) vs the reference's
    float32 gradient, along random directions."""
    _, _, grad = value_and_grad("reference", inp, cfg, jit=False)
    z = as64(inp.logits)
    rng = np.random.default_rng(seed)
    for _ in range(directions):
        v = rng.normal(size=z.shape)
        plus = _oracle(inp, cfg, logits=z + h * v)[0]
        minus = _oracle(inp, cfg, logits=z - h * v)[0]
        fd = (plus - minus) / (2 * h)
        np.testing.assert_allclose(np.sum(as64(grad) * v), fd, rtol=1e-3, atol=1e-6)


def test_dapo_num_items_in_batch():
    cfg = GRPOLossConfig(loss_type="dapo")
    inp = random_inputs(4, 3, 6, 20, jnp.float32, cfg)
    loss, _, _ = value_and_grad("reference", inp, cfg, jit=False, num_items_in_batch=40.0)
    np.testing.assert_allclose(float(loss), _oracle(inp, cfg, num_items=40.0)[0], rtol=1e-5)


def test_temperature_divides_logits_before_softmax():
    """log_softmax(z / t) is not log_softmax(z) / t (the earlier JAX code's form) unless t = 1."""
    cfg = GRPOLossConfig(temperature=0.5)
    inp = random_inputs(5, 2, 4, 30, jnp.float32, cfg)
    _, metrics, _ = value_and_grad("reference", inp, cfg, jit=False)
    z = as64(inp.logits)
    ids = np.asarray(inp.ids)[..., None]
    right = np.take_along_axis(z / 0.5 - np.log(np.exp(z / 0.5).sum(-1, keepdims=True)), ids, -1)
    wrong = np.take_along_axis(z - np.log(np.exp(z).sum(-1, keepdims=True)), ids, -1) / 0.5
    np.testing.assert_allclose(as64(metrics["logp"]), right[..., 0], rtol=1e-5)
    assert np.max(np.abs(right - wrong)) > 0.1


FAMILY = family_grid(T)


@pytest.mark.parametrize("cfg", FAMILY, ids=family_id)
def test_family_matches_float64_oracle(cfg):
    """CISPO, SAPO, VESPO, LUSPO, the sampler corrections, the off-policy mask, the KL bias
    correction and the entropy terms: the value and the two parts of the loss."""
    inp = random_inputs(8, B, T, V, jnp.float32, cfg, noise=0.3)
    loss, metrics, grad = value_and_grad("reference", inp, cfg, jit=False)
    want, want_m = _oracle(inp, cfg)
    assert np.isfinite(float(loss)) and np.isfinite(as64(grad)).all()
    np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-6)
    for key in ("kl", "entropy", "policy_loss", "kl_loss"):
        np.testing.assert_allclose(float(metrics[key]), want_m[key], rtol=1e-5, atol=1e-6,
                                   err_msg=key)


# CISPO and VESPO detach their weights (TRL does): their gradient is not the value's
# derivative, and tests/objective/test_gradient.py checks it against its formula instead.
DIFFERENTIABLE = [c for c in FAMILY if c.loss_type not in ("cispo", "vespo")]


@pytest.mark.parametrize("cfg", DIFFERENTIABLE, ids=family_id)
def test_family_gradient_matches_oracle_finite_differences(cfg):
    """The gradient, entropy bonus included, against central differences of the oracle."""
    inp = random_inputs(9, 2, 5, 31, jnp.float32, cfg, noise=0.3)
    assert_gradient_matches_finite_differences(inp, cfg, seed=2, directions=2)
