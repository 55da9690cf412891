"""The fused XLA head's entropy quantile in one pass and a correction (ops/lm_head_loss/
xla_quantile.py): exact against the reference and against the two-pass path whatever the
threshold's estimate is, with ties at the quantile, and a correction that visits few rows
when the estimate is good."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_kernels import GRPOLossConfig, LmHeadBlockSizes, grpo_loss_from_hidden
from grpo_kernels.objective.batch import TokenBatch
from grpo_kernels.ops.lm_head_loss import xla as head_xla
from grpo_kernels.ops.lm_head_loss import xla_quantile
from grpo_kernels.ops.lm_head_loss.xla_sweep import Head, head_sweep
from tests.helpers import rel_err
from tests.ops.lm_head_loss.test_lm_head import T, assert_close, make_inputs

CHUNKS = LmHeadBlockSizes(chunk_tokens=8)


def quantile_config(loss_type: str = "grpo", rho: float = 0.3) -> GRPOLossConfig:
    return GRPOLossConfig(loss_type=loss_type, beta=0.04, entropy_coef=0.05,
                          top_entropy_quantile=rho, temperature=0.8, max_completion_length=T)


def fixed_and_selected(inputs, cfg) -> tuple[int, int]:
    """``(fixed, selected)``: how many rows the correction visits, and how many tokens the
    batch's quantile selects (the estimate and one statistics sweep, as the op forms them)."""
    hidden, w, ids, mask, adv, extra, _ = inputs
    batch = TokenBatch.of(ids, mask, adv, **extra)
    h = hidden.reshape(-1, hidden.shape[-1])
    head = Head(w, None, "hv", w.dtype, cpu=jax.default_backend() == "cpu")
    flat_ids = batch.clamped_ids(head.vocab).reshape(-1)
    quantile = xla_quantile.QuantilePass.estimate(h, flat_ids, head, cfg.temperature, 8, batch,
                                                  cfg)
    (logp, _, ent), _ = head_sweep(h, flat_ids, head, cfg.temperature, 8, None)
    exact, _, fix = quantile.rows_to_fix(logp, ent)
    return int(jnp.sum(fix)), int(jnp.sum(exact.h != 0))


# Each dW mode with each layout once; the two loss types between them (grpo's bonus
# denominator counts the selected tokens, dapo's does not).
POOR_RUNS = [("grpo", "tokens", "hv", False), ("dapo", "vocab", "hv", False),
             ("dapo", "tokens", "vh", True), ("grpo", "vocab", "vh", True)]


@pytest.mark.parametrize("loss_type,dweight,layout,bias", POOR_RUNS,
                         ids=["-".join(map(str, r)) for r in POOR_RUNS])
def test_a_poor_estimate_is_corrected_to_the_reference(monkeypatch, loss_type, dweight, layout,
                                                       bias):
    """Three sampled rows of 26 make a poor threshold: the pass forms many tokens' gradients
    with the wrong selection (for grpo also the bonus's wrong denominator), and the correction
    puts them right (float32, the core tolerance)."""
    monkeypatch.setattr(xla_quantile, "SAMPLE_ROWS", 3)
    cfg = quantile_config(loss_type)
    inputs = make_inputs(21, layout=layout, bias=bias)
    if layout == "hv":
        fixed, _ = fixed_and_selected(inputs, cfg)
        assert fixed >= 3, fixed  # the test exercises the correction
    assert_close("xla", inputs, cfg, layout,
                 options=LmHeadBlockSizes(chunk_tokens=8, dweight=dweight))


def test_an_estimate_from_masked_rows_only_selects_everything_then_corrects(monkeypatch):
    """The sampled rows all outside the mask: the estimate is 0, the pass selects every masked
    token, and the correction takes the policy term off all but the batch's top 30%."""
    monkeypatch.setattr(xla_quantile, "SAMPLE_ROWS", 3)
    hidden, w, ids, mask, adv, extra, bias = make_inputs(22)
    n = mask.size
    flat = mask.reshape(-1).at[np.arange(3) * n // 3].set(0.0)
    inputs = (hidden, w, ids, flat.reshape(mask.shape), adv, extra, bias)
    cfg = quantile_config("bnpo")
    fixed, selected = fixed_and_selected(inputs, cfg)
    assert fixed >= int(jnp.sum(flat)) - selected > 0
    assert_close("xla", inputs, cfg, options=CHUNKS)


# The ties are exact under XLA:CPU's default emitters; on its legacy ones dW is 5e-4 (relative)
# from the two-pass path's, the loss and dhidden still within 1e-6.
@pytest.mark.default_emitters
def test_ties_at_the_quantile_correct_every_selected_token(monkeypatch):
    """Most rows share one hidden state, so their entropies tie at the quantile: the batch
    selects all of them, more than distinct entropies would, so the bonus's denominator
    differs from the predicted one and every selected token is corrected. Against the two-pass
    path on the same entropies: the reference's own matmul need not make the ties exact."""
    hidden, w, ids, mask, adv, extra, bias = make_inputs(23)
    tied = jnp.broadcast_to(hidden[0, 0], hidden.shape)
    hidden = jnp.where(jnp.arange(T)[None, :, None] % 5 == 4, hidden, tied)
    inputs = (hidden, w, ids, jnp.ones_like(mask), adv, extra, bias)
    cfg = quantile_config("grpo")
    fixed, selected = fixed_and_selected(inputs, cfg)
    assert selected > 0.5 * mask.size and fixed >= selected
    assert_two_pass_agrees(monkeypatch, inputs, cfg, CHUNKS, tol=1e-6)


def test_a_sampled_estimate_fixes_few_rows():
    """1,024 random tokens, 256 of them sampled: the correction visits at most 5% of them."""
    inputs = make_inputs(24, b=4, t=256, h=64, v=512)
    cfg = quantile_config("dapo", rho=0.2)
    fixed, selected = fixed_and_selected(inputs, cfg)
    assert selected > 100 and fixed <= 0.05 * inputs[3].size, (fixed, selected)


def assert_two_pass_agrees(monkeypatch, inputs, cfg, options, tol):
    """The op equals its statistics-then-gradient path (the quantile taken as not known before
    the sweep): loss exactly, gradients within ``tol``."""
    hidden, w, ids, mask, adv, extra, _ = inputs

    def run():
        def f(hh, ww):
            return grpo_loss_from_hidden(hh, ww, ids, mask, adv, config=cfg, impl="xla",
                                         options=options, **extra)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(hidden, w)

    (loss, _), grads = run()
    with monkeypatch.context() as m:
        m.setattr(head_xla, "separable_given_selection", lambda _: False)
        (loss2, _), grads2 = run()
    assert float(loss) == float(loss2)
    for name, a, b in zip(("dhidden", "dW"), grads, grads2, strict=True):
        assert a.dtype == b.dtype and np.all(np.isfinite(np.asarray(a, np.float32)))
        assert rel_err(a, b) <= tol, (name, rel_err(a, b))


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_bfloat16_equals_the_two_pass_path(monkeypatch, loss_type):
    """bfloat16 with an estimate above every entropy (the pass selects no token, the correction
    adds the policy term of every selected one), against the two-pass path on the same
    entropies (the reference rounds its logits elsewhere and may select another token at the
    threshold): to a bfloat16 rounding (the correction's difference is rounded apart from the
    pass's)."""
    monkeypatch.setattr(xla_quantile, "masked_quantile",
                        lambda *_: (jnp.float32(jnp.inf), jnp.int32(0)))
    *inputs, extra, bias = make_inputs(25, b=2, t=64, h=128, v=2048, dtype=jnp.bfloat16)
    # On-policy and without the KL (whose k3 gradient outweighs the rest at these log-probs):
    # every selected token's policy term has a gradient, and only theirs do.
    inputs = (*inputs, {}, bias)
    cfg = dataclasses.replace(quantile_config(loss_type), beta=0.0)
    assert_two_pass_agrees(monkeypatch, inputs, cfg,
                           LmHeadBlockSizes(chunk_tokens=32), tol=2.0 ** -7)
