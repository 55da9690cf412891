"""grpo_kernels.integrations.tunix_modules: which tunix models both losses read below their
logits, and that what they read is what the model's own ``__call__`` computes: qwix LoRA
adapters included (tunix's way of adding LoRA), every other case falling back or raising."""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("tunix", reason="google-tunix is not installed (make test installs it)")
qwix = pytest.importorskip("qwix", reason="qwix is not installed (google-tunix depends on it)")

from flax import nnx  # noqa: E402
from tunix.rl import algo_core  # noqa: E402

from grpo_kernels.integrations import tunix as ours  # noqa: E402
from grpo_kernels.integrations.tunix import models as tunix_modules  # noqa: E402
from tests.integrations.test_tunix import TUNIX_LIKE, algo_config  # noqa: E402
from tests.integrations.tunix_models import (  # noqa: E402
    EOS, PAD, AdapterModel, assert_parity, halved, loss_and_grads, packed_example, tiny_model,
    train_example)

BODY = ".*attn.*|.*mlp.*"  # the decoder layers' projections, as tunix's LoRA examples adapt
# The adapters' gradients pass back through every layer's attention and LoRA products, which
# magnify float32 rounding: on jax 0.12's XLA:CPU the first layer's LoRA gradient of a tied
# Qwen2 lands 1.09e-5 from tunix's (both losses alike, each 2e-7 from tunix at the head), on
# jax 0.10 under 1e-5. A misread adapter is off by order 1.
LORA_GRAD_TOL = 2e-5


def with_lora(model, example, module_path: str):
    """``model`` adapted by qwix's LoRA (rank 4) on ``module_path``, every LoRA parameter
    moved off its initial value (B starts at zero, where an adapter changes nothing)."""
    inputs = ours.model_inputs(model, example, PAD, EOS)
    tokens = inputs.pop("input_tokens")  # by position, as tunix calls every class
    adapted = qwix.apply_lora_to_model(model, qwix.LoraProvider(
        module_path=module_path, rank=4, alpha=2.0), tokens, **inputs, cache=None,
        rngs=nnx.Rngs(3))
    lora = nnx.state(adapted, nnx.LoRAParam)
    assert jax.tree.leaves(lora), f"no LoRA parameter matched {module_path!r}"
    keys = jax.random.split(jax.random.key(7), len(jax.tree.leaves(lora)))
    leaves, tree = jax.tree.flatten(lora)
    nnx.update(adapted, jax.tree.unflatten(tree, [
        x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]))
    return adapted


@pytest.mark.parametrize("family,tied", [("qwen2", True), ("qwen3", False), ("gemma3", True)])
def test_lora_adapted_models_match_tunix(family, tied):
    """Adapters on the decoder layers act inside qwix's ``__call__``: both losses, loss and
    every gradient (LoRA's included), equal tunix's own on the adapted model."""
    model = tiny_model(family, seed=2, tied=tied)
    example = train_example(model, seed=3, sampler=True)
    adapted = with_lora(model, example, BODY)
    assert tunix_modules.head_blocker(adapted) is None
    cfg = algo_config(*TUNIX_LIKE)
    want = loss_and_grads(algo_core.grpo_loss_fn, adapted, example, cfg)
    plain = loss_and_grads(algo_core.grpo_loss_fn, model, example, cfg)
    assert abs(float(want[0]) - float(plain[0])) > 1e-3  # the adapters change the loss
    for fn in (ours.logits_policy_loss, ours.fused_policy_loss):
        assert_parity(f"{family}-lora-{fn.__name__}",
                      loss_and_grads(fn, adapted, example, cfg), want,
                      grad_tol=LORA_GRAD_TOL)
    assert not jax.tree.leaves(nnx.state(adapted, nnx.Intermediate))  # nothing left sown


@pytest.mark.parametrize("case", ["lora-on-head", "own-call"])
def test_models_not_read_fall_back_or_raise(case):
    """A model whose logits cannot be formed from its hidden states and head weights: the
    logits-level loss calls the model (and equals tunix's), the fused loss raises why."""
    if case == "lora-on-head":
        model = tiny_model("qwen3", seed=4)
        example = train_example(model, seed=5)
        model, reason = with_lora(model, example, ".*lm_head.*"), "LM head carries qwix LoRA"
    elif case == "qwix-llama3":
        model = tiny_model("llama3", seed=4)
        example = train_example(model, seed=5)
        model, reason = with_lora(model, example, BODY), "inside Llama3.__call__"
    elif case == "own-call":
        model = tiny_model("qwen2", seed=4, tied=True)
        example = train_example(model, seed=5)
        model, reason = halved(model), "HalvedLogits has its own __call__"
    assert re.search(reason, tunix_modules.head_blocker(model)), tunix_modules.head_blocker(model)
    cfg = algo_config(*TUNIX_LIKE)
    want = loss_and_grads(algo_core.grpo_loss_fn, model, example, cfg)
    assert_parity(case, loss_and_grads(ours.logits_policy_loss, model, example, cfg),
                  want)
    with pytest.raises(ValueError, match=f"grpo_kernels_fused needs .*{reason}"):
        ours.fused_policy_loss(model, example, cfg, PAD, EOS)


def test_qwix_llama3_is_read_where_its_call_skips_the_head():
    """A qwix-adapted Llama3: tunix's head returns its hidden states from its own (adapted)
    ``__call__`` with ``skip_lm_head=True``, so both losses read it and equal tunix's; 0.1.7's
    returns none, so the logits-level loss calls it and the fused loss says why not."""
    model = tiny_model("llama3", seed=4)
    example = train_example(model, seed=5)
    adapted = with_lora(model, example, BODY)
    cfg = algo_config(*TUNIX_LIKE)
    want = loss_and_grads(algo_core.grpo_loss_fn, adapted, example, cfg)
    if tunix_modules.skips_lm_head(adapted):
        assert tunix_modules.head_blocker(adapted) is None
        for fn in (ours.logits_policy_loss, ours.fused_policy_loss):
            assert_parity(f"llama3-lora-{fn.__name__}",
                          loss_and_grads(fn, adapted, example, cfg), want)
        return
    reason = "inside Llama3.__call__"
    assert re.search(reason, tunix_modules.head_blocker(adapted))
    assert_parity("llama3-lora-logits", loss_and_grads(ours.logits_policy_loss, adapted,
                                                       example, cfg), want)
    with pytest.raises(ValueError, match=f"grpo_kernels_fused needs .*{reason}"):
        ours.fused_policy_loss(adapted, example, cfg, PAD, EOS)


def test_soft_capped_gemma_is_read_with_its_cap():
    """Gemma 2's final-logit soft cap: both losses read the model (the cap goes to the ops as
    logit_softcap) and equal tunix's loss, gradients included; the cap is active (0.05, where
    the tiny model's logits are of order 0.1)."""
    model = tiny_model("gemma", seed=4, softcap=0.05)
    example = train_example(model, seed=5)
    assert tunix_modules.head_blocker(model) is None
    cfg = algo_config(*TUNIX_LIKE)
    want = loss_and_grads(algo_core.grpo_loss_fn, model, example, cfg)
    for fn in (ours.logits_policy_loss, ours.fused_policy_loss):
        assert_parity(f"softcap-{fn.__name__}",
                      loss_and_grads(fn, model, example, cfg), want)
    uncapped = tiny_model("gemma", seed=4)
    assert abs(float(loss_and_grads(algo_core.grpo_loss_fn, uncapped, example, cfg)[0]) - float(want[0])) > 1e-4


def test_completion_logits_are_the_models_before_its_float32_cast():
    """A bfloat16 Qwen2: the logits formed from the head are bf16 and equal, after the exact
    upcast, the completion's slice of the model's float32 logits (to bf16 rounding: the same
    products, maybe summed in another order)."""
    model = tiny_model("qwen2", seed=6, tied=True, dtype=jnp.bfloat16)
    example = train_example(model, seed=7)
    inputs = ours.model_inputs(model, example, PAD, EOS)
    t = example.completion_ids.shape[1]
    mine = tunix_modules.completion_logits(model, inputs, t)
    theirs = model(**inputs, cache=None)[0][:, -t - 1:-1, :]
    assert mine.dtype == jnp.bfloat16 and theirs.dtype == jnp.float32
    err = jnp.max(jnp.abs(mine.astype(jnp.float32) - theirs)) / jnp.max(jnp.abs(theirs))
    assert float(err) <= 2 ** -7, float(err)


def test_logits_from_is_checked():
    model = tiny_model("qwen3", seed=0)
    example = train_example(model, seed=1)
    with pytest.raises(ValueError, match="logits_from: must be one of"):
        ours.logits_policy_loss(model, example, algo_config(*TUNIX_LIKE), PAD, EOS,
                                logits_from="head")
    with pytest.raises(ValueError, match="logits_from: must be one of"):
        ours.register(logits_from="hidden")


@pytest.mark.default_emitters
def test_lora_update_drops_the_models_unused_logits():
    """A qwix-adapted model's hidden states come from its own ``__call__``, which also forms
    every position's float32 logits; under ``jit`` nothing reads them and XLA drops them: one
    jitted update of the LoRA parameters (V = 16,384) plans less than one float32 ``[B, T, V]``
    (tunix's own loss plans more than three)."""
    from grpo_kernels import LmHeadBlockSizes

    model = tiny_model("qwen3", seed=8)
    model.lm_head.w.value = jnp.zeros((32, 16_384), jnp.float32)
    model.embedder.input_embedding.value = jax.random.normal(jax.random.key(1), (16_384, 32))
    example = train_example(model, seed=9, batch=4, prompt=8, completion=64)
    adapted = with_lora(model, example, BODY)
    graphdef, lora, rest = nnx.split(adapted, nnx.LoRAParam, ...)
    cfg = algo_config("token-mean", "low_var_kl", "grpo", None)

    def f(p):
        return ours.differentiated(ours.fused_policy_loss(
            nnx.merge(graphdef, p, rest), example, cfg, PAD, EOS,
            options=LmHeadBlockSizes(chunk_tokens=32)))
    temp = jax.jit(jax.value_and_grad(f)).lower(lora).compile().memory_analysis() \
        .temp_size_in_bytes
    logits_f32 = 4 * 4 * 64 * 16_384
    assert temp < 0.75 * logits_f32, (temp, logits_f32)


def test_a_model_of_tunixs_chunked_protocol_is_read_by_its_head_function():
    """MaxText's adapter interface (a stand-in: ``skip_lm_head`` hidden states before the
    final norm, ``compute_final_logits`` applying norm, head and a soft cap; no weights we
    read): both losses equal tunix's, unpacked and packed; the fused loss forms the logits a
    few positions at a time."""
    from grpo_kernels import LmHeadBlockSizes

    model = AdapterModel(seed=3)
    assert tunix_modules.reading(model) == "function"
    cfg = algo_config(*TUNIX_LIKE)
    for example in (train_example(model, seed=4, sampler=True), packed_example(model, seed=5)):
        want = loss_and_grads(algo_core.grpo_loss_fn, model, example, cfg)
        chunked = functools.partial(ours.fused_policy_loss,
                                    options=LmHeadBlockSizes(chunk_tokens=6))
        for name, fn in (("logits", ours.logits_policy_loss), ("fused", ours.fused_policy_loss),
                         ("fused-chunks", chunked)):
            assert_parity(f"adapter-{name}", loss_and_grads(fn, model, example, cfg),
                          want)


@pytest.mark.default_emitters
def test_head_function_update_holds_no_logits():
    """Compile-only, V = 16,384: one jitted update of the stand-in through its
    ``compute_final_logits`` in chunks of 16 tokens plans less than half of one float32
    ``[B, T, V]`` (a chunk's logits and the few float32 arrays of their log-softmax and
    gradient, about five chunks' worth, twice that at 32 tokens); tunix's own loss plans more
    than two."""
    from grpo_kernels import LmHeadBlockSizes

    model = AdapterModel(vocab=16_384, seed=6)
    example = train_example(model, seed=7, batch=4, prompt=8, completion=64, vocab=16_384)
    cfg = algo_config("token-mean", "low_var_kl", "grpo", None)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def temp(fn):
        def f(p):
            return ours.differentiated(fn(nnx.merge(graphdef, p, rest), example, cfg, PAD, EOS))
        return jax.jit(jax.value_and_grad(f)).lower(params).compile().memory_analysis() \
            .temp_size_in_bytes
    logits_f32 = 4 * 4 * 64 * 16_384
    fused = [temp(functools.partial(ours.fused_policy_loss,
                                    options=LmHeadBlockSizes(chunk_tokens=n))) for n in (16, 32)]
    assert temp(algo_core.grpo_loss_fn) > 2 * logits_f32
    assert fused[0] < 0.5 * logits_f32 and 1.8 < fused[1] / fused[0] < 2.2, fused
