"""grpo_kernels.integrations.tunix against tunix's own "grpo" loss on tiny random tunix models,
on whichever tunix is installed (0.1.7, or its development head: make test runs this file
against both).

The parity grid: every loss_agg_mode x kl_loss_mode x loss_algo x (epsilon_c on /
off) x (sampler weights on / off) (against the head, every pair of them), loss and gradients
w.r.t. every model parameter, float32 relative error <= 1e-5, for both registered losses; then
packed rows (every aggregation, both algorithms) and the head's chunked log-prob mode.
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

tunix_available = pytest.importorskip(
    "tunix", reason="google-tunix is not installed (make test installs grpo-kernels[tunix])")

from tunix.rl import algo_core, function_registry  # noqa: E402
from tunix.rl.grpo.grpo_learner import GRPOConfig  # noqa: E402

from grpo_kernels import LmHeadBlockSizes  # noqa: E402
from grpo_kernels.config import LOSS_AGG_MODES  # noqa: E402
from grpo_kernels.integrations import tunix as ours  # noqa: E402
from grpo_kernels.integrations.tunix import models as tunix_modules  # noqa: E402
from grpo_kernels.integrations.tunix import offers  # noqa: E402
from tests.helpers import pairwise  # noqa: E402
from tests.ops.lm_head_loss.test_lookup import WIDENS_BF16_SCATTER  # noqa: E402
from tests.integrations.tunix_models import (  # noqa: E402
    EOS, PAD, assert_parity, loss_and_grads, max_rel_err, packed_example, tiny_model,
    train_example)
KL_MODES = ("kl", "mse_kl", "low_var_kl")
FACTORS = (LOSS_AGG_MODES, KL_MODES, ("grpo", "gspo-token"), (None, 3.0), (False, True))


def pytest_generate_tests(metafunc):
    """The parity grid (``--tunix-grid``): by default every pair of options (each level of
    each factor meets each level of every other; the ops under the losses are one code path
    whatever the combination), ``full`` every combination (docs/integrations/tunix.md records
    the whole product against both tunix versions)."""
    if "case" not in metafunc.fixturenames:
        return
    grid = metafunc.config.getoption("--tunix-grid")
    cases = list(itertools.product(*FACTORS)) if grid == "full" else pairwise(*FACTORS)
    metafunc.parametrize("case", cases, ids=[grid_id(c) for c in cases])


def grid_id(case):
    agg, kl, algo, eps_c, sampler = case
    return f"{agg}-{kl}-{algo}-c{eps_c}-{'sampler' if sampler else 'nosampler'}"


def algo_config(agg, kl, algo, eps_c, **kw):
    cfg = GRPOConfig(loss_agg_mode=agg, kl_loss_mode=kl, loss_algo=algo, beta=0.04,
                     epsilon=0.2, num_generations=2, **kw)
    cfg.epsilon_high = 0.28  # as DAPO's config carries it; GRPOConfig reads it by getattr
    cfg.epsilon_c = eps_c
    cfg.temperature = 0.7  # the learner copies the rollout temperature here
    return cfg


@pytest.fixture(scope="module")
def qwen3():
    model = tiny_model("qwen3", seed=0)
    return model, {s: train_example(model, seed=1, sampler=s) for s in (False, True)}


def test_both_losses_are_registered():
    for name, fn in (("grpo_kernels", ours.logits_policy_loss),
                     ("grpo_kernels_fused", ours.fused_policy_loss)):
        registered = function_registry.get_policy_loss_fn(name)
        assert registered.func is fn
        assert registered.keywords == {"impl": "auto", "options": None,
                                       **({"logits_from": "auto"} if name == "grpo_kernels"
                                          else {})}
    chunks = LmHeadBlockSizes(chunk_tokens=16)
    try:
        ours.register(impl="xla", fused_options=chunks)
        fused = function_registry.get_policy_loss_fn("grpo_kernels_fused")
        assert fused.keywords == {"impl": "xla", "options": chunks}
    finally:
        ours.register()


# The grid runs eagerly: jitting every case (tunix's loss and both of ours, ~13 s of compiling
# a case here) would take 26 minutes; op by op the cases share their compiled ops (~0.5 s each).
# test_jitted_update_matches below runs the jitted programs.
def test_parity_with_tunix_grpo(qwen3, case):
    model, examples = qwen3
    *cfg_args, sampler = case
    cfg = algo_config(*cfg_args)
    example = examples[sampler]
    want, want_aux, want_g = loss_and_grads(algo_core.grpo_loss_fn, model, example, cfg,
                                            jit=False)
    for fn in (ours.logits_policy_loss, ours.fused_policy_loss):
        loss, aux, grads = loss_and_grads(fn, model, example, cfg, jit=False)
        assert_parity(fn.__name__, (loss, aux, grads), (want, want_aux, want_g))


TUNIX_LIKE = ("sequence-mean-token-mean", "low_var_kl", "gspo-token", 3.0)
LOSSES = (ours.logits_policy_loss, ours.fused_policy_loss)


@pytest.fixture(scope="module")
def packed():
    model = tiny_model("qwen2", seed=20, tied=True)
    return model, packed_example(model, seed=21, sampler=True)


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_packed_rows_match_tunix(packed, agg):
    """Packed rows as tunix packs them, gspo-token and grpo: the installed tunix's own loss
    (0.1.7: aggregated per row; the head: per segment) and both of ours. Where tunix refuses
    the combination (the head's sequence-mean-token-scale without a norm), ours refuses it
    too."""
    model, example = packed
    for algo in ("grpo", "gspo-token"):
        cfg = algo_config(agg, "low_var_kl", algo, 3.0)
        try:
            want = loss_and_grads(algo_core.grpo_loss_fn, model, example, cfg, jit=False)
        except ValueError as e:
            assert "norm" in str(e)
            for fn in LOSSES:
                with pytest.raises(ValueError, match="loss_agg_norm"):
                    loss_and_grads(fn, model, example, cfg, jit=False)
            continue
        for fn in LOSSES:
            assert_parity(f"packed-{algo}-{fn.__name__}",
                          loss_and_grads(fn, model, example, cfg, jit=False), want)


def test_packing_matters(packed):
    """The rows' segments change what the objective computes (so the test above could not
    pass by ignoring them where tunix pools per segment): on this example, per segment and per
    row give different losses."""
    from grpo_kernels import GRPOLossConfig, Segments, grpo_loss

    model, example = packed
    ex = ours.example_inputs(example)
    z = jax.random.normal(jax.random.key(0), (*ex.ids.shape, 31))
    seg = Segments(example.segment_ids[:, 1:], 5)
    losses = [float(grpo_loss(z, ex.ids, ex.mask, ex.advantages, config=GRPOLossConfig(
        loss_agg_mode="sequence-mean-token-mean", importance_sampling_level="sequence_token"),
        old_logps=ex.old_logps, segments=s)[0]) for s in (seg, None)]
    assert abs(losses[0] - losses[1]) > 1e-3, losses


def test_chunked_mode_gives_the_same_result(qwen3):
    """tunix's head with compute_logps_chunk_size > 0 (its learner passes it to every policy
    loss): tunix's own loss, chunked, against ours given the same keyword."""
    model, examples = qwen3
    cfg = algo_config(*TUNIX_LIKE)
    want = loss_and_grads(algo_core.grpo_loss_fn, model, examples[True], cfg, jit=False,
                          compute_logps_chunk_size=3)
    for fn in LOSSES:
        assert_parity(f"chunked-{fn.__name__}", loss_and_grads(
            fn, model, examples[True], cfg, jit=False, compute_logps_chunk_size=3), want)


@pytest.mark.parametrize("family,tied", [("qwen2", True), ("qwen2", False), ("qwen3", True),
                                         ("llama3", False), ("llama3", True), ("gemma3", True),
                                         ("gemma", True)])
def test_model_families(family, tied):
    model = tiny_model(family, seed=2, tied=tied)
    example = train_example(model, seed=3, sampler=True)
    cfg = algo_config(*TUNIX_LIKE)
    want = loss_and_grads(algo_core.grpo_loss_fn, model, example, cfg, jit=False)
    called = functools.partial(ours.logits_policy_loss, logits_from="model")
    for name, fn in (("logits", ours.logits_policy_loss), ("logits-model-call", called),
                     ("fused", ours.fused_policy_loss)):
        assert_parity(f"{family}-{name}", loss_and_grads(fn, model, example, cfg, jit=False),
                      want)


def test_jitted_update_matches(qwen3):
    """Under jit, as tunix's trainer runs the loss."""
    model, examples = qwen3
    cfg = algo_config("token-mean", "kl", "grpo", None)
    want = loss_and_grads(algo_core.grpo_loss_fn, model, examples[True], cfg)
    assert_parity("fused-jit", loss_and_grads(ours.fused_policy_loss, model, examples[True],
                                              cfg), want)


@pytest.mark.parametrize("family,tied", [("qwen2", True), ("qwen3", False), ("llama3", False)])
def test_hidden_states_times_head_are_the_model_logits(family, tied):
    model = tiny_model(family, seed=4, tied=tied)
    example = train_example(model, seed=5)
    inputs = ours.model_inputs(model, example, PAD, EOS)
    logits, _ = model(**inputs, cache=None)
    hidden, table = tunix_modules.hidden_states(model, inputs)
    head = tunix_modules.lm_head(model, hidden, table)
    spec = "bld,dv->blv" if head.layout == "hv" else "bld,vd->blv"
    mine = jnp.einsum(spec, hidden.astype(head.dtype), head.weights)
    np.testing.assert_allclose(np.asarray(mine, np.float64), np.asarray(logits, np.float64),
                               rtol=1e-5, atol=1e-5)


def test_bf16_model_within_rounding(qwen3):
    """A bfloat16 Qwen3 (float32 parameters): the fused head rounds each logit to bf16 once,
    as tunix's einsum in bf16 does; the two agree to bf16 precision, not bit for bit."""
    model = tiny_model("qwen3", seed=6, dtype=jnp.bfloat16)
    example = train_example(model, seed=7, sampler=True)
    cfg = algo_config(*TUNIX_LIKE)
    want = loss_and_grads(algo_core.grpo_loss_fn, model, example, cfg, jit=False)
    for fn in (ours.logits_policy_loss, ours.fused_policy_loss):
        loss, _, grads = loss_and_grads(fn, model, example, cfg, jit=False)
        np.testing.assert_allclose(float(loss), float(want[0]), rtol=2e-2)
        assert max_rel_err(grads, want[2]) <= 5e-2, fn.__name__


@pytest.mark.default_emitters
def test_fused_update_holds_no_logits_sized_temporaries():
    """Compiled temp bytes of one update (value_and_grad, jit) at V = 16,384: tunix's loss keeps
    float32 [B, T, V] logits and their softmax; the fused loss, in chunks of 32 tokens, stays far
    below one such copy. (The default chunk is 256 MiB on CPU: this shape fits in one.)"""
    from flax import nnx

    model = tiny_model("qwen3", seed=8)
    model.lm_head.w.value = jnp.zeros((32, 16_384), jnp.float32)  # a large vocabulary
    model.embedder.input_embedding.value = jnp.zeros((16_384, 32), jnp.float32)
    example = train_example(model, seed=9, batch=4, prompt=8, completion=64)
    cfg = algo_config("token-mean", "low_var_kl", "grpo", None)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def temp_bytes(fn):
        def f(p):
            return ours.differentiated(fn(nnx.merge(graphdef, p, rest), example, cfg, PAD, EOS))
        step = jax.jit(jax.value_and_grad(f))
        return step.lower(params).compile().memory_analysis().temp_size_in_bytes

    logits_f32 = 4 * 4 * 64 * 16_384
    fused = functools.partial(ours.fused_policy_loss,
                              options=LmHeadBlockSizes(chunk_tokens=32))
    tunix_bytes, fused_bytes = temp_bytes(algo_core.grpo_loss_fn), temp_bytes(fused)
    assert tunix_bytes > 2 * logits_f32
    assert fused_bytes < 0.5 * logits_f32, (fused_bytes, tunix_bytes)


@pytest.mark.default_emitters
def test_tied_bf16_update_plans_no_float32_copy_of_the_embedding(monkeypatch):
    """A tied bfloat16 Qwen3, one jitted update: the fused loss's lookup (tied_lookup) adds its
    gradient into the head's; the plain ``table[ids]`` lookup in its place plans a float32
    scatter-add the size of the table (two more table-sized bf16 copies) on XLA:CPU (jaxlib
    0.12's: one bf16 copy)."""
    from flax import nnx

    if jax.default_backend() != "cpu":
        pytest.skip("the float32 widening of a bfloat16 scatter-add is XLA:CPU's")
    vocab, hidden = 16_384, 32
    model = tiny_model("qwen3", seed=8, tied=True, dtype=jnp.bfloat16)
    model.embedder.input_embedding.value = jax.random.normal(
        jax.random.key(0), (vocab, hidden), jnp.bfloat16)
    example = train_example(model, seed=9, batch=4, prompt=8, completion=64)
    cfg = algo_config("token-mean", "low_var_kl", "grpo", None)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def temp_bytes():
        def f(p):
            return ours.differentiated(ours.fused_policy_loss(nnx.merge(graphdef, p, rest),
                                                              example, cfg, PAD, EOS))
        return jax.jit(jax.value_and_grad(f)).lower(params).compile().memory_analysis() \
            .temp_size_in_bytes

    table = 2 * vocab * hidden
    fused = temp_bytes()
    monkeypatch.setattr(tunix_modules, "tied_lookup", lambda t, ids: (t[ids], t))
    plain = temp_bytes()
    # jaxlib 0.12's XLA:CPU no longer widens the scatter-add (tests/ops/lm_head_loss/
    # test_lookup.py): the saving is then one table-sized bf16 copy, not that and a float32 one
    saved = 1.5 if WIDENS_BF16_SCATTER else 0.9
    assert plain - fused >= saved * table, (fused, plain, table)


def test_fused_default_forms_dweight_by_vocabulary_blocks():
    """Registered without options, the fused loss runs XLA with dweight="vocab" (no float32
    [H, V] accumulator; tests/ops/lm_head_loss checks what that plans); given options, or on
    Pallas, it takes what it is given."""
    assert ours.fused_options("auto", None) == LmHeadBlockSizes(dweight="vocab")
    assert ours.fused_options("xla", None) == LmHeadBlockSizes(dweight="vocab")
    assert ours.fused_options("pallas", None) is None
    chunks = LmHeadBlockSizes(chunk_tokens=16)
    assert ours.fused_options("auto", chunks) is chunks


def test_logits_default_aliases_the_pallas_gradient():
    """Registered without options, the logits-level loss on Pallas writes its gradient over
    the logits (tests/benchmarks/test_tpu_compile.py checks what that plans); xla and given
    options are left alone. On this CPU, auto resolves to xla."""
    from grpo_kernels.ops.logits_loss import PallasOptions

    assert ours.logits_options("pallas", None) == PallasOptions(alias_logits=True)
    assert ours.logits_options("xla", None) is None
    assert ours.logits_options("auto", None) is None
    given = PallasOptions(one_pass=False)
    assert ours.logits_options("pallas", given) is given


class NotATunixModel:
    pass


def test_errors_name_the_field():
    model = tiny_model("qwen3", seed=0)
    example = train_example(model, seed=1)
    cfg = algo_config(*TUNIX_LIKE)
    with pytest.raises(ValueError, match="NotATunixModel is not a tunix Qwen2, Qwen3, Llama3"):
        ours.fused_policy_loss(NotATunixModel(), example, cfg, PAD, EOS)
    packed = dataclasses.replace(example, segment_ids=jnp.ones_like(example.completion_ids),
                                 segment_positions=jnp.zeros_like(example.completion_ids))
    with pytest.raises(ValueError, match=r"train_example.prompt_ids must be empty \(\[B, 0\]\)"):
        ours.fused_policy_loss(model, packed, cfg, PAD, EOS)
    if offers.packs_per_segment():
        unbounded = dataclasses.replace(packed, prompt_ids=packed.prompt_ids[:, :0])
        with pytest.raises(ValueError, match="train_example.num_segments must be set"):
            ours.fused_policy_loss(model, unbounded, cfg, PAD, EOS)
    per_token = dataclasses.replace(example, advantages=jnp.ones((4, 3)))
    with pytest.raises(ValueError, match=r"train_example.advantages must be \[B\]"):
        ours.logits_policy_loss(model, per_token, cfg, PAD, EOS)
    for field, value, match in (("kl_loss_mode", "js", "GRPOConfig.kl_loss_mode"),
                                ("epsilon_c", 0.5, "GRPOConfig.epsilon_c"),
                                ("loss_agg_mode", "sum", "GRPOConfig.loss_agg_mode"),
                                ("kl_clamp_value", -1.0, "GRPOConfig.kl_clamp_value")):
        bad = algo_config(*TUNIX_LIKE)
        setattr(bad, field, value)
        with pytest.raises(ValueError, match=match):
            ours.loss_config(bad, has_ref=True)


def test_config_mapping():
    cfg = ours.loss_config(algo_config(*TUNIX_LIKE), has_ref=True)
    assert (cfg.kl_estimator, cfg.importance_sampling_level, cfg.dual_clip) == (
        "k3", "sequence_token", 3.0)
    assert (cfg.log_ratio_clamp, cfg.sequence_log_ratio_max) == (20.0, 10.0)
    assert (cfg.epsilon_low, cfg.epsilon_high, cfg.temperature) == (0.2, 0.28, 0.7)
    assert ours.loss_config(algo_config(*TUNIX_LIKE), has_ref=False).beta == 0.0
    zero_t = algo_config(*TUNIX_LIKE)
    zero_t.temperature = 0.0
    assert ours.loss_config(zero_t, has_ref=True).temperature == 1.0
