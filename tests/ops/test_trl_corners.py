"""TRL 1.16's two corners in every implementation, against the float64 oracle of TRL's formula.

1. LUSPO aggregates ``(per_token_loss * mask).sum(-1).mean()`` (``GRPOTrainer._compute_loss``),
   which differs from Liger-Kernel 0.8.5's ``(per_token_loss * mask.sum(-1, keepdim=True))
   .mean()`` wherever the per-token loss varies along a sequence: token level, a KL term, the
   entropy mask.
2. The entropy bonus is a token mean over the tokens the policy term acts on, for every loss
   type: ``num_items_in_batch`` divides the policy term of dapo, cispo and vespo, never the
   bonus.

Each corner at token and sequence level, the dtype alternating; the logits loss (reference,
xla, the Pallas TPU and GPU kernels interpreted, alternating) and the fused head (reference,
xla with dW by tokens and by vocabulary blocks, alternating, the Pallas kernels interpreted).
Values against the oracle, gradients against the reference; the 8-device meshes run the same
corners in tests/sharding/test_sharding.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_kernels import (GRPOLossConfig, LmHeadBlockSizes, LmHeadPallasBlockSizes,
                          LmHeadPallasOptions, grpo_loss_from_hidden)
from grpo_kernels.ops.logits_loss.inputs import random_inputs
from tests.helpers import as64, family_id, reference_value_and_grad, rel_err, value_and_grad
from tests.oracle import oracle
from tests.ops.logits_loss.test_impls import TOL
from tests.ops.logits_loss.test_pallas import small_blocks

NUM_ITEMS = 70.0  # more than the masks hold, so it differs from the token count
CORNERS = [
    GRPOLossConfig(loss_type="luspo", delta=1.5),
    GRPOLossConfig(loss_type="luspo", importance_sampling_level="sequence", beta=0.04,
                   temperature=0.7),
    GRPOLossConfig(loss_type="luspo", entropy_coef=0.02, top_entropy_quantile=0.5),
    GRPOLossConfig(loss_type="dapo", importance_sampling_level="sequence", entropy_coef=0.02),
    GRPOLossConfig(loss_type="cispo", epsilon_high=1.05, entropy_coef=0.02),
    GRPOLossConfig(loss_type="vespo", importance_sampling_level="sequence", entropy_coef=0.02,
                   top_entropy_quantile=0.5),
]
IDS = [family_id(c) for c in CORNERS]


def _dtype(index):
    return (jnp.float32, jnp.bfloat16)[index % 2]


def _oracle_of(logits, ids, mask, adv, cfg, old, ref, sampler_logps=None):
    return oracle(logits, np.asarray(ids), as64(mask), as64(adv), cfg, as64(old),
                  None if ref is None else as64(ref), num_items=NUM_ITEMS,
                  sampler_logps=sampler_logps)[0]


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
@pytest.mark.parametrize("index", range(len(CORNERS)), ids=IDS)
def test_logits_loss_equals_trl(impl, index):
    """The Pallas kernel alternates over the corners (TPU, GPU), so each kernel meets both
    dtypes, both corners and both levels."""
    cfg, dtype = CORNERS[index], _dtype(index)
    options = ("tpu", "gpu")[index // 2 % 2] if impl == "pallas" else None
    inp = random_inputs(30 + index, 3, 7, 1000, dtype, cfg, noise=0.3)
    kw = {"num_items_in_batch": NUM_ITEMS}
    if options is not None:
        kw["options"] = small_blocks(options, dtype)
    loss, _, grad = value_and_grad(impl, inp, cfg, **kw)
    want = _oracle_of(as64(inp.logits), inp.ids, inp.mask, inp.advantages, cfg, inp.old_logps,
                      inp.ref_logps)
    assert np.isfinite(float(loss)) and np.isfinite(as64(grad)).all()
    np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-6)
    if impl != "reference":
        _, _, grad_r = reference_value_and_grad(inp, cfg, **{"num_items_in_batch": NUM_ITEMS})
        assert rel_err(grad, grad_r) <= TOL[dtype]["grad"]


HEAD = dict(b=2, t=9, h=128, v=512)
HEAD_OPTIONS = {
    "xla-tokens": ("xla", LmHeadBlockSizes(chunk_tokens=8)),
    "xla-vocab": ("xla", LmHeadBlockSizes(chunk_tokens=8, dweight="vocab")),
    "pallas": ("pallas", LmHeadPallasOptions(blocks=LmHeadPallasBlockSizes(
        block_rows=16, block_vocab=256, block_hidden=128))),
}


def _head_inputs(seed, dtype):
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    b, t, h, v = HEAD["b"], HEAD["t"], HEAD["h"], HEAD["v"]
    hidden = jax.random.normal(k[0], (b, t, h), jnp.float32).astype(dtype)
    w = (jax.random.normal(k[1], (h, v), jnp.float32) * 2.0 / np.sqrt(h)).astype(dtype)
    lengths = jnp.array([t, 3])
    mask = (jnp.arange(t)[None, :] < lengths[:, None]).astype(jnp.float32)
    ids = jax.random.randint(k[2], (b, t), 0, v)
    adv = jax.random.normal(k[3], (b,), jnp.float32)
    old = jax.random.normal(k[4], (b, t), jnp.float32) * 0.3 - float(np.log(v))
    ref = old + 0.1 * jax.random.normal(k[5], (b, t))
    return hidden, w, ids, mask, adv, old, ref


def _head_run(impl, options, inputs, cfg):
    """bf16 operands with float32 logits (an f32 head): the oracle's logits, unrounded."""
    hidden, w, ids, mask, adv, old, ref = inputs

    def f(hh, ww):
        return grpo_loss_from_hidden(hh, ww, ids, mask, adv, config=cfg, impl=impl,
                                     old_logps=old, ref_logps=ref, options=options,
                                     num_items_in_batch=NUM_ITEMS,
                                     logits_dtype=jnp.float32)[0]

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(hidden, w)


@pytest.mark.parametrize("variant", ["reference", "xla", "pallas"])
@pytest.mark.parametrize("index", range(len(CORNERS)), ids=IDS)
def test_fused_head_equals_trl(variant, index):
    """xla's dW mode alternates over the corners (by tokens, by vocabulary blocks)."""
    cfg, dtype = CORNERS[index], _dtype(index + 1)
    if variant == "xla":
        variant = ("xla-tokens", "xla-vocab")[index // 2 % 2]
    inputs = _head_inputs(50 + index, dtype)
    impl, options = HEAD_OPTIONS.get(variant, ("reference", None))
    loss, grads = _head_run(impl, options, inputs, cfg)
    hidden, w, ids, mask, adv, old, ref = inputs
    want = _oracle_of(as64(hidden) @ as64(w), ids, mask, adv, cfg, old, ref)
    assert np.isfinite(float(loss))
    np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-6)
    if variant != "reference":
        _, grads_r = _head_run("reference", None, inputs, cfg)
        tol = 1e-5 if dtype == jnp.float32 else 1e-2
        for name, a, b in zip(("dhidden", "dW"), grads, grads_r, strict=True):
            assert rel_err(a, b) <= tol, (name, rel_err(a, b))
