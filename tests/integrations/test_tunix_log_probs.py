"""``patch_log_probs``: tunix's ``compute_per_token_logps`` without ``[B, P + T, V]``, on
whichever tunix is installed. Parity with tunix's own function for every model family our
adapter reads and for every way tunix calls it (the head's five callers: reference pass with
packed rows, vanilla rollout, the actor pass with ``chunk_size``, ``grpo_loss_fn`` and
``ppo_policy_loss_fn`` differentiating it), by head weights and by ``compute_final_logits``;
every case it does not handle goes to tunix's function unchanged; patching and unpatching
restore tunix's object."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tunix", reason="google-tunix is not installed (make test installs it)")

from flax import nnx  # noqa: E402
from tunix.rl import algo_core, common  # noqa: E402

from grpo_kernels.integrations import tunix as ours  # noqa: E402
from grpo_kernels.integrations.tunix import offers  # noqa: E402
from tests.integrations.test_tunix import TUNIX_LIKE, algo_config  # noqa: E402
from tests.integrations.tunix_models import (  # noqa: E402
    EOS, PAD, AdapterModel, assert_parity, halved, loss_and_grads, packed_example, tiny_model,
    train_example)

TUNIX = common.compute_per_token_logps
PARAMS = offers.parameters(TUNIX)
# How the installed tunix's callers call it: (caller, packed rows?, keywords). The head's five
# (rl/inference/inference_worker.py, rl/rollout/vanilla_rollout.py, rl/rl_cluster.py,
# rl/algo_core.py twice); 0.1.7's differentiating loss asks for logits, which is tunix's.
CALLS = [("reference", True, dict(stop_gradient=True, temperature=0.7)),
         ("rollout", False, dict(stop_gradient=True)),
         ("actor", False, dict(stop_gradient=True, temperature=0.7, chunk_size=4)),
         ("actor-packed", True, dict(stop_gradient=True, temperature=0.7, chunk_size=4)),
         ("grpo_loss", True, dict(stop_gradient=False, return_entropy=True, temperature=0.7,
                                  chunk_size=0)),
         ("grpo_loss-chunked", False, dict(stop_gradient=False, return_entropy=True,
                                           temperature=0.7, chunk_size=3)),
         ("ppo", False, dict(stop_gradient=False, return_entropy=True, chunk_size=0))]
CALLS = [(name, packed, kw) for name, packed, kw in CALLS if set(kw) <= set(PARAMS)]


def _args(model, seed=1):
    ex = train_example(model, seed=seed)
    graphdef, state = nnx.split(model)
    return graphdef, state, ex.prompt_ids, ex.completion_ids


def _rel(a, b):
    """Max |a - b| over max |b| (the difference itself where b is all zero)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.max(np.abs(b))
    return float(np.max(np.abs(a - b)) / (scale if scale > 0 else 1.0))


@pytest.mark.parametrize("family, tied, tau", [
    ("qwen2", True, 1.0), ("qwen2", False, 0.7), ("qwen3", True, 0.7), ("qwen3", False, 1.0),
    ("llama3", False, 0.7), ("llama3", True, 0.0), ("gemma3", True, 0.7), ("gemma", True, 1.0)])
def test_patched_pass_equals_tunix(family, tied, tau):
    model = tiny_model(family, seed=2, tied=tied)
    graphdef, state, prompt, completion = _args(model)
    want = TUNIX(graphdef, state, prompt, completion, PAD, EOS, temperature=tau)
    got = ours.log_probs_function("xla")(graphdef, state, prompt, completion, PAD, EOS,
                                         temperature=tau)
    assert got.dtype == jnp.float32 and got.shape == want.shape
    assert _rel(got, want) <= 1e-5, (family, tied, tau)


def test_bf16_model_within_rounding():
    model = tiny_model("qwen3", seed=3, dtype=jnp.bfloat16)
    graphdef, state, prompt, completion = _args(model)
    want = TUNIX(graphdef, state, prompt, completion, PAD, EOS)
    got = ours.log_probs_function()(graphdef, state, prompt, completion, PAD, EOS)
    # both round each logit to bf16 once; the log-softmax's sums differ in order only
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=2e-2)


def test_gradients_when_not_stopped():
    """stop_gradient=False: the log-probs' gradient w.r.t. the parameters is tunix's."""
    model = tiny_model("qwen2", seed=4, tied=True)
    graphdef, state, prompt, completion = _args(model)
    w = jax.random.normal(jax.random.key(0), completion.shape)

    def grads(fn):
        return jax.grad(lambda st: jnp.sum(w * fn(graphdef, st, prompt, completion, PAD, EOS,
                                                  stop_gradient=False)))(state)
    want, got = grads(TUNIX), grads(ours.log_probs_function("xla"))
    for g, g_r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert _rel(g, g_r) <= 1e-5


@pytest.mark.parametrize("reading", ["head", "function"])
def test_every_call_tunix_makes_equals_tunix(reading):
    """Each of the installed tunix's call patterns, patched against unpatched: log-probs,
    entropies, and where the caller differentiates, the gradient of every parameter; read by
    the head's weights (a Qwen2) and by ``compute_final_logits`` (MaxText's interface)."""
    model = tiny_model("qwen2", seed=7, tied=True) if reading == "head" else AdapterModel()
    graphdef, state = nnx.split(model)
    ex, pk = train_example(model, seed=8), packed_example(model, seed=9)
    plain = dict(prompt_tokens=ex.prompt_ids, completion_tokens=ex.completion_ids)
    packed = dict(prompt_tokens=pk.prompt_ids, completion_tokens=pk.completion_ids,
                  segment_ids=pk.segment_ids, segment_positions=pk.segment_positions)
    fn = ours.log_probs_function("xla")
    for i, (name, is_packed, kw) in enumerate(CALLS):
        args = {**(packed if is_packed else plain), "pad_id": PAD, "eos_id": EOS, **kw}

        def run(f, st):
            out = f(graphdef, st, **args)
            return out if isinstance(out, tuple) else (out,)
        got, want = run(fn, state), run(TUNIX, state)
        assert fn.calls == {"ours": i + 1, "tunix": 0}, name
        assert len(got) == len(want), name
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == jnp.float32, name
            assert _rel(a, b) <= 1e-5, (name, _rel(a, b))
        if kw["stop_gradient"]:
            continue
        w = [jax.random.normal(jax.random.key(i), x.shape) for i, x in enumerate(want)]

        def grads(f):
            return jax.grad(lambda st: sum(jnp.sum(wi * x) for wi, x in zip(w, run(f, st))))(
                state)
        for g, g_r in zip(jax.tree.leaves(grads(fn)), jax.tree.leaves(grads(TUNIX)),
                          strict=True):
            assert _rel(g, g_r) <= 1e-5, name
        fn.calls["ours"] -= 1  # the gradient's call, not one of the patterns


def test_tunix_loss_with_the_patch_equals_without():
    """tunix's own grpo loss calls the function by name: patched, it runs ours (on the head,
    differentiated, with entropies) and gives tunix's loss and gradients."""
    model = tiny_model("qwen3", seed=10)
    example = train_example(model, seed=11, sampler=True)
    cfg = algo_config(*TUNIX_LIKE)
    want = loss_and_grads(algo_core.grpo_loss_fn, model, example, cfg)
    with ours.log_probs_patched("xla"):
        got = loss_and_grads(algo_core.grpo_loss_fn, model, example, cfg)
        answered = common.compute_per_token_logps.calls
    assert_parity("grpo-patched", got, want)
    # the head's loss asks for entropies, which we answer; 0.1.7's asks for logits: tunix's
    assert answered == ({"ours": 1, "tunix": 0} if "return_entropy" in PARAMS else
                        {"ours": 0, "tunix": 1})


def test_every_case_it_does_not_handle_goes_to_tunix_unchanged():
    calls = []

    @functools.wraps(TUNIX)
    def spy(*args, **kwargs):
        calls.append(kwargs)
        return TUNIX(*args, **kwargs)

    model = tiny_model("qwen3", seed=5)
    graphdef, state, prompt, completion = _args(model)
    fn = ours.log_probs_function("xla", tunix_fn=spy)
    if "return_logits" in PARAMS:  # 0.1.7
        logps, logits = fn(graphdef, state, prompt, completion, PAD, EOS, return_logits=True)
        assert calls[-1]["return_logits"] and logits.shape[-1] == 257
    else:  # the head has no such argument: tunix's own error
        with pytest.raises(TypeError, match="return_logits"):
            fn(graphdef, state, prompt, completion, PAD, EOS, return_logits=True)
        assert calls[-1] == {"return_logits": True}
    positions = jnp.broadcast_to(jnp.arange(prompt.shape[1] + completion.shape[1]),
                                 (prompt.shape[0], prompt.shape[1] + completion.shape[1]))
    packed = jnp.concatenate([prompt, completion], axis=1)
    with pytest.raises(ValueError, match="segment_positions must be explicitly provided"):
        fn(graphdef, state, prompt[:, :0], packed, PAD, EOS, segment_ids=jnp.ones_like(packed))
    assert calls[-1]["segment_ids"] is not None
    fn(graphdef, state, prompt, completion, PAD, EOS, temperature=-1.0)
    assert calls[-1] == {"temperature": -1.0}
    with pytest.raises(TypeError, match="unexpected keyword"):
        fn(graphdef, state, prompt, completion, PAD, EOS, logits_to_keep=3)
    assert calls[-1]["logits_to_keep"] == 3
    n = len(calls)
    fn(graphdef, state, prompt, completion, PAD, EOS)  # handled: no call to tunix
    fn(graphdef, state, prompt[:, :0], packed, PAD, EOS, segment_ids=jnp.ones_like(packed),
       segment_positions=positions)
    assert len(calls) == n
    assert fn.calls == {"ours": 2, "tunix": 4}


def test_soft_capped_gemma_equals_tunix():
    """Gemma 2's final-logit soft cap through logit_softcap (0.05: active at the tiny model's
    logits, of order 0.1)."""
    model = tiny_model("gemma", seed=6, softcap=0.05)
    graphdef, state, prompt, completion = _args(model)
    want = TUNIX(graphdef, state, prompt, completion, PAD, EOS, temperature=0.7)
    fn = ours.log_probs_function("xla")
    got = fn(graphdef, state, prompt, completion, PAD, EOS, temperature=0.7)
    assert fn.calls == {"ours": 1, "tunix": 0} and _rel(got, want) <= 1e-5


def test_a_model_it_cannot_read_goes_to_tunix():
    """A subclass with its own __call__: tunix's function, inlined in the same jitted pass
    with the arguments the caller gave, gives the numbers."""
    calls = []

    @functools.wraps(TUNIX)
    def spy(*args, **kwargs):
        calls.append(kwargs)
        return TUNIX(*args, **kwargs)

    model = halved(tiny_model("qwen2", seed=6, tied=True))
    graphdef, state, prompt, completion = _args(model)
    got = ours.log_probs_function("xla", tunix_fn=spy)(graphdef, state, prompt, completion,
                                                      PAD, EOS)
    assert calls
    np.testing.assert_array_equal(np.asarray(got), np.asarray(
        TUNIX(graphdef, state, prompt, completion, PAD, EOS)))


def test_patch_and_unpatch_restore_tunix_function():
    assert common.compute_per_token_logps is TUNIX
    ours.patch_log_probs()
    try:
        assert common.compute_per_token_logps.grpo_kernels
        ours.patch_log_probs(impl="xla")  # again: new options, tunix's function kept
        assert common.compute_per_token_logps is not TUNIX
    finally:
        ours.unpatch_log_probs()
    assert common.compute_per_token_logps is TUNIX
    ours.unpatch_log_probs()  # nothing bound: a no-op
    assert common.compute_per_token_logps is TUNIX
    with pytest.raises(RuntimeError):
        with ours.log_probs_patched():
            assert common.compute_per_token_logps.grpo_kernels
            raise RuntimeError("inside")
    assert common.compute_per_token_logps is TUNIX


@pytest.mark.default_emitters
def test_patched_pass_plans_no_logits():
    """Compile-only, V = 16,384, 4 x (128 + 1,024) tokens, no decoder layers (the head and the
    log-softmax alone, as benchmarks/tunix_memory.py measures them): tunix's pass plans
    float32 [B, P + T, V] logits; ours no logits-sized temporary at all."""
    from tunix.models.qwen3 import model as m

    config = m.ModelConfig(num_layers=0, embed_dim=64, hidden_dim=64, num_heads=4, head_dim=16,
                           num_kv_heads=2, vocab_size=16384, rope_theta=10_000, norm_eps=1e-6,
                           use_tied_embedding=True, dtype=jnp.bfloat16,
                           param_dtype=jnp.bfloat16)
    model = nnx.eval_shape(lambda: m.Qwen3(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    prompt, completion = (jax.ShapeDtypeStruct((4, n), jnp.int32) for n in (128, 1024))
    logits_f32 = 4 * (128 + 1024) * 16384 * 4

    def temp(fn):
        return jax.jit(lambda st, p, c: fn(graphdef, st, p, c, PAD, EOS)).lower(
            state, prompt, completion).compile().memory_analysis().temp_size_in_bytes
    assert temp(TUNIX) >= logits_f32
    assert temp(ours.log_probs_function("xla")) < 0.1 * logits_f32
