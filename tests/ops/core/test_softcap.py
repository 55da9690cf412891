"""``logit_softcap`` (Gemma 2's final-logit cap, :math:`c \\tanh(z / c)` before the temperature)
in both loss ops and both log-prob ops: the float64 oracle of the capped logits checks the
reference; the reference checks xla and every Pallas kernel (TPU two-kernel and one-pass, GPU
rows, aligned and one-pass, the TPU head), values and gradients, at a ragged V = 300."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_kernels import (
    GRPOLossConfig,
    LmHeadBlockSizes,
    LmHeadPallasBlockSizes,
    LmHeadPallasOptions,
    PallasBlockSizes,
    PallasOptions,
    XlaBlockSizes,
    grpo_loss,
    grpo_loss_from_hidden,
    token_logps,
    token_logps_from_hidden,
)
from grpo_kernels.ops.lm_head_loss.inputs import random_head_inputs
from grpo_kernels.ops.logits_loss.inputs import random_inputs
from tests.helpers import as64, rel_err
from tests.oracle import oracle

CAP = 3.0  # the logits have a standard deviation of about 2 here: the cap bends most of them
CONFIGS = [GRPOLossConfig(beta=0.04, temperature=0.7, max_completion_length=9),
           GRPOLossConfig(loss_type="dapo", importance_sampling_level="sequence",
                          entropy_coef=0.02, max_completion_length=9)]


TPU = PallasBlockSizes(block_rows=16, block_vocab=128)
# The logits loss's fast implementations: xla, then each Pallas kernel; the one-pass kernels
# meet the token-level config, the two-kernel ones the sequence-level config with an entropy
# bonus (the GPU rows layout meets both).
LOGITS_IMPLS = {
    "xla": ("xla", XlaBlockSizes(chunk_tokens=5, block_vocab=128)),
    "pallas-tpu": ("pallas", PallasOptions(kernel="tpu", blocks=TPU, one_pass=False)),
    "pallas-tpu-one-pass": ("pallas", PallasOptions(kernel="tpu", blocks=TPU, one_pass=True)),
    **{f"pallas-gpu-{layout}": ("pallas", PallasOptions(
        kernel="gpu", gpu_layout=layout, blocks=PallasBlockSizes(block_vocab=128)))
       for layout in ("rows", "aligned")},
    "pallas-gpu-one-pass": ("pallas", PallasOptions(
        kernel="gpu", one_pass=True, blocks=PallasBlockSizes(block_vocab=128))),
}
HEAD_PALLAS = LmHeadPallasOptions(blocks=LmHeadPallasBlockSizes(block_rows=16, block_vocab=128))


def _program(impl: str):
    """How ``impl`` runs here: the fast implementations jitted, one program each (op by op, an
    interpreted Pallas kernel's body dispatches every operation of every grid step from Python,
    2-3x the time of compiling it here); the reference op by op, its primitives shared with the
    other tests."""
    return (lambda f: f) if impl == "reference" else jax.jit


def _capped64(z):
    z = np.asarray(jnp.asarray(z, jnp.float32), np.float64)
    return CAP * np.tanh(z / CAP)


@pytest.mark.parametrize("cfg", CONFIGS, ids=["grpo-kl", "dapo-seq-entropy"])
def test_logits_loss_with_a_cap(cfg):
    inp = random_inputs(0, 3, 9, 300, jnp.float32, cfg)
    want, _ = oracle(_capped64(inp.logits), inp.ids, inp.mask, inp.advantages, cfg,
                     old=inp.old_logps, ref=inp.ref_logps)

    def run(impl, options=None):
        step = jax.value_and_grad(lambda z: grpo_loss(
            z, inp.ids, inp.mask, inp.advantages, config=cfg, impl=impl, options=options,
            logit_softcap=CAP, **inp.kwargs())[0])
        return _program(impl)(step)(inp.logits)

    ref_loss, ref_grad = run("reference")
    np.testing.assert_allclose(float(ref_loss), want, rtol=1e-5, atol=1e-6)
    token = cfg.importance_sampling_level == "token"
    for name, (impl, options) in LOGITS_IMPLS.items():
        if name not in ("xla", "pallas-gpu-rows") and ("one-pass" in name) != token:
            continue
        loss, grad = run(impl, options)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-6, atol=2e-6,
                                   err_msg=name)
        assert rel_err(grad, ref_grad) <= 2e-5, name
    uncapped = grpo_loss(inp.logits, inp.ids, inp.mask, inp.advantages, config=cfg,
                         impl="reference", **inp.kwargs())[0]
    assert abs(float(uncapped) - float(ref_loss)) > 1e-4  # the cap is active


@pytest.mark.parametrize("cfg", CONFIGS, ids=["grpo-kl", "dapo-seq-entropy"])
@pytest.mark.parametrize("dweight", ["tokens", "vocab"])
def test_fused_loss_with_a_cap(cfg, dweight):
    inp = random_head_inputs(1, 2, 9, 16, 300, jnp.float32, cfg, layout="vh")

    def run(impl, options=None):
        step = jax.value_and_grad(lambda h, w: grpo_loss_from_hidden(
            h, w, inp.ids, inp.mask, inp.advantages, config=cfg, impl=impl, options=options,
            lm_head_layout="vh", logit_softcap=CAP, old_logps=inp.old_logps,
            ref_logps=inp.ref_logps)[0], argnums=(0, 1))
        return _program(impl)(step)(inp.hidden, inp.lm_head)

    ref_loss, ref_grads = run("reference")
    z = jnp.einsum("bth,vh->btv", inp.hidden, inp.lm_head)
    want, _ = oracle(_capped64(z), inp.ids, inp.mask, inp.advantages, cfg,
                     old=inp.old_logps, ref=inp.ref_logps)
    np.testing.assert_allclose(float(ref_loss), want, rtol=1e-5, atol=1e-6)
    fast = [("xla", LmHeadBlockSizes(chunk_tokens=8, dweight=dweight))]
    if dweight == "tokens" and cfg.entropy_coef:  # the TPU head kernels form dW one way
        fast.append(("pallas", HEAD_PALLAS))
    for impl, options in fast:
        loss, grads = run(impl, options)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-6, atol=2e-6,
                                   err_msg=impl)
        for g, g_r in zip(grads, ref_grads):
            assert rel_err(g, g_r) <= 2e-5, impl


def test_log_prob_ops_with_a_cap():
    k = jax.random.split(jax.random.key(2), 3)
    h = jax.random.normal(k[0], (2, 7, 16))
    w = 0.6 * jax.random.normal(k[1], (16, 200))
    ids = jax.random.randint(k[2], (2, 7), 0, 200)
    z = h @ w
    s = _capped64(z) / 0.8
    s = s - s.max(-1, keepdims=True)
    want = np.take_along_axis(s - np.log(np.exp(s).sum(-1, keepdims=True)),
                              np.asarray(ids)[..., None], -1)[..., 0]
    head_options = {"xla": LmHeadBlockSizes(chunk_tokens=8), "pallas": HEAD_PALLAS}
    logits_options = {"pallas": PallasOptions(blocks=TPU)}
    for impl in ("reference", "xla", "pallas"):
        program = _program(impl)
        got = program(lambda z: token_logps(z, ids, temperature=0.8, impl=impl,
                                            options=logits_options.get(impl),
                                            logit_softcap=CAP))(z)
        np.testing.assert_allclose(as64(got), want, atol=2e-5, err_msg=impl)
        got = program(lambda h: token_logps_from_hidden(
            h, w, ids, temperature=0.8, impl=impl, logit_softcap=CAP,
            options=head_options.get(impl)))(h)
        np.testing.assert_allclose(as64(got), want, atol=2e-5, err_msg=impl)
    g_r = jax.grad(lambda h: jnp.sum(token_logps_from_hidden(h, w, ids, impl="reference",
                                                             logit_softcap=CAP)))(h)
    g = jax.jit(jax.grad(lambda h: jnp.sum(token_logps_from_hidden(
        h, w, ids, impl="xla", options=head_options["xla"], logit_softcap=CAP))))(h)
    assert rel_err(g, g_r) <= 2e-5  # the Pallas head's gradients: test_fused_loss_with_a_cap


@pytest.mark.parametrize("value, message", [
    (0.0, "logit_softcap must be None or a finite number > 0, got 0.0"),
    (-3, "logit_softcap must be None or a finite number > 0, got -3"),
    (float("inf"), "logit_softcap must be None or a finite number > 0"),
    (True, "logit_softcap must be None or a finite number > 0, got True"),
])
def test_bad_caps_are_named(value, message):
    z = jnp.zeros((1, 2, 5))
    with pytest.raises(ValueError, match=None) as e:
        token_logps(z, jnp.zeros((1, 2), jnp.int32), logit_softcap=value)
    assert message in str(e.value)

