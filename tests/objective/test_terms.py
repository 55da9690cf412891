"""objective.terms: the per-token weights, the KL estimator, the policy terms and the per-token
gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective import (
    kl_divergence,
    kl_k3,
    masked_mean,
    policy_term,
    token_loss_grad,
    token_separable,
    token_terms,
    token_weights,
)
from tests.helpers import objective

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
    want = jax.grad(lambda lp: objective(lp, MASK, adv, cfg, old, ref)[0])(logp)
    got = token_loss_grad(logp, {"weights": token_weights(MASK, cfg), "advantages": adv[:, None],
                                 "old_logp": old, "ref_logp": ref}, cfg)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)
    assert float(jnp.abs(want).max()) > 0


def test_sequence_level_is_not_token_separable():
    cfg = GRPOLossConfig(importance_sampling_level="sequence")
    assert not token_separable(cfg)
    with pytest.raises(ValueError, match="token-separable"):
        token_loss_grad(jnp.zeros(3), {"weights": jnp.ones(3), "advantages": jnp.ones(3)}, cfg)


@pytest.mark.parametrize("mode,want_row0,want_row1", [
    ("token-mean", 1 / 4, 1 / 4),
    ("sequence-mean-token-mean", 1 / (3 * 2), 1 / 2),  # R = 2 non-empty rows of 3
    ("sequence-mean-token-scale", 1 / (4 * 2), 1 / (4 * 2)),  # T = 4
    ("seq-mean-token-sum", 1 / 2, 1 / 2),
    ("sequence-mean-token-sum-norm", 1 / 2, 1 / 2)])
def test_tunix_aggregation_weights(mode, want_row0, want_row1):
    for loss_type in ("grpo", "dr_grpo"):  # loss_agg_mode replaces the loss_type's rule
        cfg = GRPOLossConfig(loss_agg_mode=mode, loss_type=loss_type, max_completion_length=9)
        w = np.asarray(token_weights(MASK, cfg))
        np.testing.assert_allclose(w[0, :3], want_row0, rtol=1e-6)
        np.testing.assert_allclose(w[1, 0], want_row1, rtol=1e-6)
        assert (w[MASK == 0] == 0).all()


def test_kl_estimators_and_clamp():
    lp = jnp.array([-1.0, -2.0, -0.1])
    ref = lp + jnp.array([0.3, -0.5, 1.0])
    d = np.array([0.3, -0.5, 1.0])
    for name, want in (("k3", np.exp(d) - d - 1), ("k1", -d), ("k2", d * d / 2)):
        got = kl_divergence(lp, ref, GRPOLossConfig(kl_estimator=name))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        clamped = kl_divergence(lp, ref, GRPOLossConfig(kl_estimator=name, kl_clamp=0.2))
        np.testing.assert_allclose(clamped, np.clip(want, -0.2, 0.2), rtol=1e-6, atol=1e-7)


def test_dual_clip_caps_the_loss_of_negative_advantages():
    cfg = GRPOLossConfig(dual_clip=3.0, epsilon_high=10.0)
    log_ratio = jnp.log(jnp.array([5.0, 5.0, 0.5]))
    adv = jnp.array([-1.0, 1.0, -1.0])
    terms = token_terms(jnp.zeros(3), log_ratio, adv, cfg)
    # A < 0 at ratio 5: min(5, 3) = 3; A > 0 untouched; ratio 0.5 below the cap.
    np.testing.assert_allclose(terms["policy"], [3.0, -5.0, 0.8], rtol=1e-6)


def _seq_inputs(seed, noise=0.3):
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    logp = -jnp.abs(jax.random.normal(k[0], MASK.shape))
    old = logp + noise * jax.random.normal(k[1], MASK.shape)
    adv = jax.random.normal(k[2], (MASK.shape[0],))
    sampler = jax.random.uniform(k[3], MASK.shape, minval=0.2, maxval=2.0)
    return logp, old, adv, sampler


def test_gspo_token_equals_gspo_without_per_token_weights():
    logp, old, adv, _ = _seq_inputs(4)
    cfgs = [GRPOLossConfig(importance_sampling_level=lvl, loss_agg_mode=mode)
            for lvl in ("sequence", "sequence_token") for mode in (None, "token-mean")]
    for seq, tok in zip(cfgs[:2], cfgs[2:], strict=True):
        def f(c):
            return jax.value_and_grad(lambda lp: objective(lp, MASK, adv, c, old)[0])(logp)
        (v1, g1), (v2, g2) = f(seq), f(tok)
        np.testing.assert_allclose(v1, v2, rtol=1e-6)
        np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-8)
        assert float(jnp.abs(g1).max()) > 0


def test_gspo_token_gradient_formula_with_sampler_weights():
    r"""GSPO-token: :math:`\partial L / \partial \log\pi_{bt} = w_{bt} s_{bt} \, \partial p /
    \partial r (r_b)` with the sequence's ratio, token by token (no spreading over the
    sequence, unlike GSPO), and zero past the sequence cap."""
    logp, old, adv, sampler = _seq_inputs(5, noise=0.05)  # ratios inside the clip range
    m = np.asarray(MASK, np.float64)
    d = np.asarray(logp - old, np.float64)
    r = (d * m).sum(-1, keepdims=True) / np.maximum(m.sum(-1, keepdims=True), 1)
    assert r[0, 0] != r[1, 0]
    for cap in (None, float(r[:2, 0].mean())):  # caps one of the two non-empty rows
        cfg = GRPOLossConfig(importance_sampling_level="sequence_token", epsilon_high=0.28,
                             sequence_log_ratio_max=cap)
        got = jax.grad(lambda lp: objective(lp, MASK, adv, cfg, old,
                                                 sampler_weights=sampler)[0])(logp)
        a = np.asarray(adv, np.float64)[:, None]
        ratio = np.exp(r)
        # d/dr of -min(ratio A, clip(ratio) A): -A ratio where the unclipped term is the min.
        clipped = np.clip(ratio, 0.8, 1.28)
        active = ratio * a <= clipped * a
        dp_dr = np.where(active, -a * ratio, 0.0)
        if cap is not None:
            dp_dr = np.where(r > cap, 0.0, dp_dr)
        w = np.asarray(token_weights(MASK, cfg), np.float64)
        want = w * np.asarray(sampler, np.float64) * dp_dr
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-8)
        assert (np.abs(want).max(-1) > 0).sum() == (2 if cap is None else 1)


def test_new_loss_types_weights():
    """sapo aggregates as grpo; cispo and vespo as dapo; luspo sums each row over its tokens
    and takes the mean over rows (TRL 1.16's ``(per_token_loss * mask).sum(-1).mean()``)."""
    def weights(loss_type, **kw):
        return np.asarray(token_weights(MASK, GRPOLossConfig(loss_type=loss_type), **kw))

    np.testing.assert_allclose(weights("sapo"), weights("grpo"))
    for lt in ("cispo", "vespo"):
        np.testing.assert_allclose(weights(lt, num_items_in_batch=8.0),
                                   weights("dapo", num_items_in_batch=8.0))
    np.testing.assert_allclose(weights("luspo"), MASK / 3)


def test_policy_terms_of_the_new_loss_types():
    logp = jnp.array([-1.0, -2.0, -0.5, -1.5])
    log_ratio = jnp.log(jnp.array([1.3, 0.6, 6.0, 1.0]))
    adv = jnp.array([1.0, -1.0, 2.0, -0.5])
    c = np.array([1.3, 0.6, 6.0, 1.0])
    a, lp = np.asarray(adv, np.float64), np.asarray(logp, np.float64)
    cispo = policy_term(logp, log_ratio, adv, GRPOLossConfig(loss_type="cispo",
                                                             epsilon_high=5.0))[0]
    np.testing.assert_allclose(cispo, -np.minimum(c, 5.0) * a * lp, rtol=1e-6)
    cfg = GRPOLossConfig(loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=2.0)
    tau = np.where(a > 0, 1.0, 2.0)
    want = -(4 / tau) / (1 + np.exp(-tau * (c - 1))) * a
    np.testing.assert_allclose(policy_term(logp, log_ratio, adv, cfg)[0], want, rtol=1e-6)
    phi = jnp.array([0.5, 2.0, 1.0, 0.0])
    vespo = policy_term(logp, log_ratio, adv, GRPOLossConfig(loss_type="vespo"), phi)[0]
    np.testing.assert_allclose(vespo, -np.asarray(phi) * a * lp, rtol=1e-6)


def test_kl_bias_correction_multiplies_by_the_unclipped_ratio():
    logp, ref = jnp.array([-1.0, -2.0]), jnp.array([-1.2, -1.5])
    log_ratio = jnp.log(jnp.array([3.0, 0.5]))
    cfg = GRPOLossConfig(beta=0.1, kl_bias_correction=True, delta=1.5)
    terms = token_terms(logp, log_ratio, jnp.ones(2), cfg, ref)
    np.testing.assert_allclose(terms["kl"], kl_k3(logp, ref) * np.array([3.0, 0.5]), rtol=1e-6)


def test_entropy_bonus_is_the_masked_token_mean():
    """loss(entropy_coef=c) = loss(0) - c * mean entropy over the masked tokens."""
    k = jax.random.split(jax.random.PRNGKey(8), 3)
    logp = -jnp.abs(jax.random.normal(k[0], MASK.shape))
    ent = jnp.abs(jax.random.normal(k[1], MASK.shape)) + 1.0
    adv = jax.random.normal(k[2], (MASK.shape[0],))
    base = objective(logp, MASK, adv, GRPOLossConfig(), entropy=ent)[0]
    got = objective(logp, MASK, adv, GRPOLossConfig(entropy_coef=0.3), entropy=ent)[0]
    m = np.asarray(MASK, np.float64)
    mean = (np.asarray(ent, np.float64) * m).sum() / m.sum()
    np.testing.assert_allclose(float(got), float(base) - 0.3 * mean, rtol=1e-6)
