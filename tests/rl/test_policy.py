"""The micro-batch loss: accumulation as TRL 1.16 accumulates, and the loss impls agreeing."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.models.config import ModelConfig
from grpo_kernels.models.decoder import Decoder
from grpo_kernels.rl.policy import Batch, loss_on, make_programs, micro_config, micro_scale

P, C, V = 5, 6, 97


def _model(dtype=jnp.float32, tied=False, param_dtype=jnp.float32):
    config = ModelConfig(family="qwen2", vocab_size=V, hidden_size=32, intermediate_size=48,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         attention_bias=True, param_dtype=param_dtype, compute_dtype=dtype,
                         tie_word_embeddings=tied)
    return Decoder(config, nnx.Rngs(3))


def _batch(rows=4, seed=0, old=False, ref=False, sampler=False):
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(2, P + 1, rows)
    attention = np.zeros((rows, P + C), np.int32)
    for i, n in enumerate(prompt_len):
        attention[i, P - n:P] = 1
    lengths = rng.integers(1, C + 1, rows)
    mask = (np.arange(C)[None] < lengths[:, None]).astype(np.int32)
    attention[:, P:] = mask
    ids = rng.integers(0, V, (rows, P + C)).astype(np.int32)
    logps = lambda: (-rng.uniform(0.5, 5.0, (rows, C)) * mask).astype(np.float32)  # noqa: E731
    return Batch(ids=ids, attention=attention, mask=mask,
                 advantages=rng.normal(size=rows).astype(np.float32), prompt_width=P,
                 old_logps=logps() if old else None, ref_logps=logps() if ref else None,
                 sampler_logps=logps() if sampler else None)


def _grads(arm, config, batch, micro, dtype=jnp.float32, logits_dtype=jnp.float32,
           entropies=None, **model_kw):
    """The trainer's accumulation over micro-batches of ``micro`` rows: ``(loss, grads)``;
    each micro-batch's entropy metric appended to ``entropies`` when given."""
    model = _model(dtype, **model_kw)
    graphdef, state = nnx.split(model)
    head, impl = arm
    mb_config = micro_config(config, batch.rows // micro)
    grad_fn, _ = make_programs(graphdef, head=head, impl=impl, config=mb_config, prompt_width=P,
                               logits_dtype=logits_dtype)
    grad_fn = jax.jit(grad_fn)
    total_tokens = int(batch.mask.sum())
    loss, grads = 0.0, None
    for start in range(0, batch.rows, micro):
        mb = {k: None if v is None else jnp.asarray(v)
              for k, v in batch.micro(start, micro).items()}
        scale = micro_scale(mb_config, micro, batch.rows)
        (part, metrics), g = grad_fn(state, mb, jnp.float32(scale), jnp.float32(total_tokens))
        loss += float(part)
        if entropies is not None:
            entropies.append(float(metrics["entropy"]))
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    return loss, grads


@pytest.mark.parametrize("loss_type, level", [
    ("grpo", "token"), ("bnpo", "sequence"), ("dr_grpo", "token"), ("dapo", "sequence"),
    ("grpo", "sequence"), ("bnpo", "token")])
def test_micro_batches_equal_the_full_batch(loss_type, level):
    config = GRPOLossConfig(loss_type=loss_type, importance_sampling_level=level, beta=0.04,
                            max_completion_length=C, temperature=0.8)
    assert_accumulation_is_exact(config, _batch(old=True, ref=True))


def assert_accumulation_is_exact(config, batch):
    """Two micro-batches of 2 rows give the loss and gradients of one batch of 4."""
    full_loss, full = _grads(("logits", "reference"), config, batch, micro=4)
    acc_loss, acc = _grads(("logits", "reference"), config, batch, micro=2)
    assert np.isfinite(full_loss) and full_loss != 0
    np.testing.assert_allclose(acc_loss, full_loss, rtol=2e-6, atol=2e-7)
    for a, b in zip(jax.tree.leaves(acc), jax.tree.leaves(full)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7)


# luspo scales by rows, cispo by num_items (sapo and vespo share those: test_micro_scale_weights)
@pytest.mark.parametrize("loss_type", ["luspo", "cispo"])
def test_micro_batches_equal_the_full_batch_for_the_new_loss_types(loss_type):
    """micro_scale weighs sapo and luspo by rows, cispo and vespo by num_items; the sampler
    log-probs of each micro-batch reach its loss (a token-level correction)."""
    config = GRPOLossConfig(loss_type=loss_type, beta=0.04, max_completion_length=C,
                            sampler_correction="token_truncate", sampler_correction_max=1.5)
    batch = _batch(old=True, ref=True, sampler=True)
    assert_accumulation_is_exact(config, batch)
    without = dataclasses.replace(batch, sampler_logps=None)
    with pytest.raises(ValueError, match="sampler_logps"):
        _grads(("logits", "reference"), config, without, micro=4)


@pytest.mark.parametrize("arm", [("fused", "xla"), ("fused", "pallas")],
                         ids=lambda a: "-".join(a))
def test_entropy_terms_agree_with_the_reference(arm):
    """The entropy bonus and quantile through the decoder: the fused head's entropy gradient
    reaches the model's parameters as the reference's does."""
    config = GRPOLossConfig(beta=0.04, entropy_coef=0.05, top_entropy_quantile=0.5)
    assert_close_to_reference(arm, config, _batch(rows=4, seed=2, old=True, ref=True), micro=4)


@pytest.mark.parametrize("arm", [("logits", "xla"), ("fused", "xla"), ("fused", "pallas")],
                         ids=lambda a: "-".join(a))
def test_impls_agree_with_the_reference(arm):
    config = GRPOLossConfig(beta=0.04, epsilon_high=0.28)
    assert_close_to_reference(arm, config, _batch(rows=4, seed=1, old=True, ref=True), micro=2)


@pytest.mark.parametrize("param_dtype, tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)],
                         ids=["f32", "bf16"])
def test_tied_fused_head_agrees_with_the_reference(param_dtype, tol):
    """A tied embedding: the fused head takes the table through tied_lookup, which adds the
    input lookup's gradient into the head's; the embedding's gradient (both parts) matches the
    logits-level reference's autodiff, to float32 or bfloat16 rounding."""
    config = GRPOLossConfig(beta=0.04, epsilon_high=0.28)
    assert_close_to_reference(("fused", "xla"), config, _batch(rows=4, seed=3, old=True, ref=True),
                              micro=2, tol=tol, tied=True, param_dtype=param_dtype)


def assert_close_to_reference(arm, config, batch, micro, tol=1e-4, **kw):
    """The arm's loss and parameter gradients against the logits-level reference's."""
    ref_loss, ref = _grads(("logits", "reference"), config, batch, micro=micro, **kw)
    loss, got = _grads(arm, config, batch, micro=micro, **kw)
    np.testing.assert_allclose(loss, ref_loss, rtol=max(1e-5, tol / 10), atol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.isfinite(a).all()
        scale = float(np.abs(b).max())
        assert float(np.abs(a - b).max()) <= tol * scale + 1e-9


def test_logp_program_returns_the_policy_logps():
    model = _model()
    graphdef, state = nnx.split(model)
    config = GRPOLossConfig(beta=0.04)
    batch = _batch(rows=3, seed=2)
    _, logp_fn = make_programs(graphdef, head="fused", impl="xla", config=config,
                               prompt_width=P)
    mb = {k: None if v is None else jnp.asarray(v) for k, v in batch.micro(0, 3).items()}
    got = np.asarray(jax.jit(logp_fn)(state, mb))
    logits = np.asarray(model(jnp.asarray(batch.ids[:, :-1]),
                              attention_mask=jnp.asarray(batch.attention[:, :-1])),
                        np.float64)[:, P - 1:]
    logits = logits - logits.max(-1, keepdims=True)
    logsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = np.take_along_axis(logsm, batch.ids[:, P:, None], -1)[..., 0]
    m = batch.mask == 1
    np.testing.assert_allclose(got[m], want[m], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arm", [("fused", "xla"), ("fused", "reference"), ("logits", "xla"),
                                 ("logits", "pallas")], ids=lambda a: "-".join(a))
def test_logp_program_equals_the_loss_logp_metric(arm):
    """The reference and old-policy passes run the forward-only op of the loss's head and
    implementation; their log-probs are the loss's own (its ``logp`` metric), at a temperature."""
    model = _model()
    graphdef, state = nnx.split(model)
    config = GRPOLossConfig(beta=0.04, temperature=0.7)
    batch = _batch(rows=3, seed=4, ref=True)
    _, logp_fn = make_programs(graphdef, head=arm[0], impl=arm[1], config=config,
                               prompt_width=P)
    mb = {k: None if v is None else jnp.asarray(v) for k, v in batch.micro(0, 3).items()}
    got = np.asarray(jax.jit(logp_fn)(state, mb))
    _, metrics = jax.jit(lambda mb: loss_on(model, mb, head=arm[0], impl=arm[1], config=config,
                                            prompt_width=P))(mb)
    np.testing.assert_allclose(got, np.asarray(metrics["logp"]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arm", [("fused", "xla"), ("logits", "pallas")],
                         ids=lambda a: "-".join(a))
def test_bf16_logits_agree_with_the_reference(arm):
    """loss.logits_dtype bfloat16: the fused head rounds its chunks' logits as the logits head
    rounds ``[N, C, V]``, and the gradients through the rounding agree to bf16's precision."""
    config = GRPOLossConfig(beta=0.04, epsilon_high=0.28)
    assert_close_to_reference(arm, config, _batch(rows=4, seed=4, old=True, ref=True), micro=2,
                              tol=2e-2, logits_dtype=jnp.bfloat16)


def _oracle_logps(model, batch, logits_dtype):
    """float64 log-probs of the completion tokens from the model's logits rounded to
    ``logits_dtype``."""
    hidden = model(jnp.asarray(batch.ids[:, :-1]),
                   attention_mask=jnp.asarray(batch.attention[:, :-1]), return_hidden=True)
    z = np.asarray(model.logits(hidden, logits_dtype), np.float64)[:, P - 1:]
    z = z - z.max(-1, keepdims=True)
    logsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return np.take_along_axis(logsm, batch.ids[:, P:, None], -1)[..., 0]


@pytest.mark.parametrize("arm", [("logits", "reference"), ("logits", "xla"),
                                 ("logits", "pallas"), ("fused", "xla"), ("fused", "pallas")],
                         ids=lambda a: "-".join(a))
def test_logits_dtype_rounds_the_logits_every_arm_sees(arm):
    """Every arm's log-probs under bfloat16 logits are the float64 log-softmax of the rounded
    logits, and not the float32 logits' (the rounding moves them by far more than the
    tolerance)."""
    model = _model()
    graphdef, state = nnx.split(model)
    batch = _batch(rows=3, seed=5)
    _, logp_fn = make_programs(graphdef, head=arm[0], impl=arm[1],
                               config=GRPOLossConfig(beta=0.04), prompt_width=P,
                               logits_dtype=jnp.bfloat16)
    mb = {k: None if v is None else jnp.asarray(v) for k, v in batch.micro(0, 3).items()}
    got = np.asarray(jax.jit(logp_fn)(state, mb), np.float64)
    m = batch.mask == 1
    rounded, exact = (_oracle_logps(model, batch, d)[m] for d in (jnp.bfloat16, jnp.float32))
    assert np.isfinite(got[m]).all()
    np.testing.assert_allclose(got[m], rounded, rtol=1e-5, atol=1e-5)
    assert np.abs(rounded - exact).max() > 1e-4


def test_micro_scale_weights():
    g = GRPOLossConfig(max_completion_length=C)
    for loss_type, want in (("grpo", 0.25), ("dr_grpo", 0.25), ("sapo", 0.25),
                            ("luspo", 0.25), ("dapo", 1.0), ("cispo", 1.0), ("vespo", 1.0)):
        assert micro_scale(dataclasses.replace(g, loss_type=loss_type), 2, 8) == want
    bnpo = micro_config(dataclasses.replace(g, loss_type="bnpo"), 4)
    assert bnpo.loss_type == "dapo" and micro_scale(bnpo, 2, 8) == 1.0


def test_micro_config():
    """bnpo runs as dapo over the batch's tokens; the num_items types' entropy coefficient is
    divided by the accumulation steps, the per-row types' not (their scale divides it)."""
    assert micro_config(GRPOLossConfig(entropy_coef=0.1), 4).entropy_coef == 0.1
    for loss_type in ("bnpo", "dapo", "cispo", "vespo"):
        got = micro_config(GRPOLossConfig(loss_type=loss_type, entropy_coef=0.1), 4)
        assert got.entropy_coef == pytest.approx(0.025)
    assert micro_config(GRPOLossConfig(loss_type="dapo"), 4) == GRPOLossConfig(loss_type="dapo")
    with pytest.raises(ValueError, match="micro_batches must be >= 1"):
        micro_config(GRPOLossConfig(), 0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        micro_config(GRPOLossConfig(loss_agg_mode="token-mean"), 2)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "cispo"])
def test_entropy_bonus_accumulates_as_trl(loss_type):
    """TRL 1.16 under accumulation: each micro-batch's token mean of the entropy over the
    accumulation steps, for every loss type. Two micro-batches of unequal token counts: the
    bonus differs from the whole batch's token mean, and the policy part is unchanged."""
    batch = _batch(old=True, ref=True)
    counts = batch.mask.sum(-1)
    assert counts[:2].sum() != counts[2:].sum()
    # a low temperature spreads the random model's entropies apart
    config = GRPOLossConfig(loss_type=loss_type, beta=0.04, max_completion_length=C,
                            temperature=0.02, epsilon_high=1.3 if loss_type == "cispo" else 0.2)
    bonus = dataclasses.replace(config, entropy_coef=0.3)
    plain, _ = _grads(("logits", "reference"), config, batch, micro=2)
    means = []
    got, _ = _grads(("logits", "reference"), bonus, batch, micro=2, entropies=means)
    want = plain - 0.3 * (means[0] + means[1]) / 2
    n = np.array([counts[:2].sum(), counts[2:].sum()], np.float64)
    whole = plain - 0.3 * float(np.dot(means, n) / n.sum())
    assert abs(want - whole) > 1e-3, (means, n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


