"""Fused LM-head loss: every implementation against the reference, which is checked against a
float64 oracle; layouts, bias, dtypes, memory, bad input, TPU lowering at the real shape."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_kernels import (GRPOLossConfig, LmHeadBlockSizes, LmHeadPallasBlockSizes,
                          LmHeadPallasOptions,
                          grpo_loss_from_hidden)
from grpo_kernels.config import CLASSIC_LOSS_TYPES
from grpo_kernels.ops.lm_head_loss import pallas_options, pallas_tpu
from grpo_kernels.ops.lm_head_loss import xla as head_xla
from grpo_kernels.ops.lm_head_loss import xla_plan as head_plan
from grpo_kernels.ops.lm_head_loss import xla_sweep, xla_vocab
from grpo_kernels.ops.lm_head_loss.head import delta_dtype
from grpo_kernels.ops.lm_head_loss.xla_plan import plan_chunk, plan_vocab_block
from tests.helpers import (as64, cached_reference, every_platform, family_grid, family_id,
                           lowered_text, option_grid, option_id, rel_err, take_plan_of)
from tests.oracle import oracle

B, T, H, V = 2, 13, 256, 1000
SMALL = {"xla": LmHeadBlockSizes(chunk_tokens=8),  # 26 rows: 3 full chunks and a tail of 2
         "pallas": LmHeadPallasOptions(blocks=LmHeadPallasBlockSizes(block_rows=16, block_vocab=256,
                                                                 block_hidden=128))}


def make_inputs(seed, b=B, t=T, h=H, v=V, dtype=jnp.float32, layout="hv", bias=False,
                scale=2.0):
    k = jax.random.split(jax.random.PRNGKey(seed), 7)
    hidden = jax.random.normal(k[0], (b, t, h), jnp.float32).astype(dtype)
    shape = (h, v) if layout == "hv" else (v, h)
    w = (jax.random.normal(k[1], shape, jnp.float32) * scale / np.sqrt(h)).astype(dtype)
    lengths = jax.random.randint(k[2], (b, 1), 1, t + 1)
    mask = (jnp.arange(t)[None, :] < lengths).astype(jnp.float32)
    ids = jax.random.randint(k[3], (b, t), 0, v)
    adv = jax.random.normal(k[4], (b,), jnp.float32)
    base = jax.random.normal(k[5], (b, t), jnp.float32) * 0.3 - float(np.log(v))
    extra = dict(old_logps=base, ref_logps=base + 0.1 * jax.random.normal(k[6], (b, t)))
    bias_v = (0.1 * jax.random.normal(k[6], (v,), jnp.float32)).astype(dtype) if bias else None
    return hidden, w, ids, mask, adv, extra, bias_v


def run(impl, inputs, cfg, layout="hv", jit=True, **kw):
    hidden, w, ids, mask, adv, extra, bias = inputs
    if impl in SMALL and "options" not in kw:
        kw["options"] = SMALL[impl]

    def f(hh, ww, bb):
        return grpo_loss_from_hidden(hh, ww, ids, mask, adv, config=cfg, impl=impl,
                                     lm_head_layout=layout, bias=bb, **extra, **kw)

    step = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)
    (loss, metrics), grads = (jax.jit(step) if jit else step)(hidden, w, bias)
    return loss, metrics, grads


def run_reference(inputs, cfg, layout="hv"):
    """:func:`run` of the reference, op by op (tests/helpers.py says why), cached per config,
    layout and inputs."""
    return cached_reference(("head", cfg, layout), inputs,
                            lambda: run("reference", inputs, cfg, layout, jit=False))


def assert_close(impl, inputs, cfg, layout="hv", tol=1e-5, **kw):
    loss_r, m_r, g_r = run_reference(inputs, cfg, layout)
    loss_k, m_k, g_k = run(impl, inputs, cfg, layout, **kw)
    assert np.isfinite(float(loss_k))
    np.testing.assert_allclose(float(loss_k), float(loss_r), rtol=tol, atol=tol)
    for name, a, b in zip(("dhidden", "dW", "dbias"), g_k, g_r, strict=True):
        if b is None:
            assert a is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, b) <= tol, (name, rel_err(a, b))
    np.testing.assert_allclose(as64(m_k["logp"]), as64(m_r["logp"]), atol=tol * 10)
    for key in ("entropy", "kl", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region",
                "policy_loss", "kl_loss"):
        np.testing.assert_allclose(float(m_k[key]), float(m_r[key]), rtol=tol, atol=tol,
                                   err_msg=key)


def test_reference_matches_float64_oracle():
    cfg = GRPOLossConfig(beta=0.04, temperature=0.7)
    inputs = make_inputs(0)
    hidden, w, ids, mask, adv, extra, _ = inputs
    loss, metrics, _ = run("reference", inputs, cfg)
    logits = np.einsum("bth,hv->btv", as64(hidden), as64(w))
    loss64, metrics64 = oracle(logits, np.asarray(ids), as64(mask), as64(adv), cfg,
                               as64(extra["old_logps"]), as64(extra["ref_logps"]))
    np.testing.assert_allclose(float(loss), loss64, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["entropy"]), metrics64["entropy"], rtol=1e-5)


CONFIGS = [GRPOLossConfig(loss_type=lt, importance_sampling_level=lvl, beta=0.04, delta=2.0,
                          temperature=0.7, max_completion_length=T)
           for lt in CLASSIC_LOSS_TYPES for lvl in ("token", "sequence")]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.loss_type}-{c.importance_sampling_level}")
def test_xla_matches_reference_f32(cfg):
    assert_close("xla", make_inputs(1), cfg)


@pytest.mark.parametrize("cfg", CONFIGS[:4], ids=lambda c: f"{c.loss_type}-{c.importance_sampling_level}")
def test_pallas_interpret_matches_reference_f32(cfg):
    assert_close("pallas", make_inputs(2), cfg)


OPTIONS = option_grid(T)
# xla runs every option; the interpreted Pallas kernel every third and the tunix-like mix.
OPTION_RUNS = [("xla", i) for i in range(len(OPTIONS))] + [
    ("pallas", i) for i in (*range(0, len(OPTIONS) - 1, 3), len(OPTIONS) - 1)]


@pytest.mark.parametrize("impl,index", OPTION_RUNS,
                         ids=[f"{impl}-{option_id(OPTIONS[i])}" for impl, i in OPTION_RUNS])
def test_options_match_reference(impl, index):
    """tunix's options and sampler weights through the fused head."""
    cfg, sampler = OPTIONS[index]
    hidden, w, ids, mask, adv, extra, _ = make_inputs(12)
    if sampler:
        extra = {**extra, "sampler_weights": jax.random.uniform(
            jax.random.PRNGKey(13), mask.shape, jnp.float32, 0.2, 2.0)}
    assert_close(impl, (hidden, w, ids, mask, adv, extra, None), cfg)


FAMILY = family_grid(T)
# The head sees the family as one pass (token-separable configs) or two, with or without the
# entropy term: xla runs the token-level variants (both paths) and the entropy ones at both
# levels with dW by tokens, the entropy ones by vocabulary blocks too; the interpreted Pallas
# kernel the entropy variants (its one new term) at token level.
FAMILY_RUNS = ([("xla", "tokens", i) for i, c in enumerate(FAMILY)
                if c.importance_sampling_level == "token" or c.entropy_coef != 0]
               + [(impl, dweight, i) for i, c in enumerate(FAMILY) if c.entropy_coef != 0
                  for impl, dweight in (("xla", "vocab"), ("pallas", None))
                  if impl == "xla" or c.importance_sampling_level == "token"])


@pytest.mark.parametrize("impl,dweight,index", FAMILY_RUNS,
                         ids=[f"{impl}-{d}-{family_id(FAMILY[i])}" for impl, d, i in FAMILY_RUNS])
def test_family_matches_reference(impl, dweight, index):
    """The 2026 family through the fused head: one pass where the config is token-separable
    (the entropy bonus's h known from the mask), two where it is not (VESPO, the masks, the
    sequence-level correction, the entropy quantile)."""
    cfg = FAMILY[index]
    hidden, w, ids, mask, adv, extra, _ = make_inputs(14)
    extra = {**extra, "sampler_logps": extra["old_logps"] + 0.3 * jax.random.normal(
        jax.random.PRNGKey(15), mask.shape)}
    kw = {} if impl == "pallas" else {"options": LmHeadBlockSizes(chunk_tokens=8,
                                                                  dweight=dweight)}
    assert_close(impl, (hidden, w, ids, mask, adv, extra, None), cfg, **kw)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("layout", ["hv", "vh"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_layouts_and_bias(impl, layout, bias):
    cfg = GRPOLossConfig(beta=0.04, importance_sampling_level="sequence")
    assert_close(impl, make_inputs(3, layout=layout, bias=bias), cfg, layout)


@pytest.mark.parametrize("layout", ["hv", "vh"])
@pytest.mark.parametrize("match", [True, False], ids=["match", "as_given"])
def test_pallas_kernels_take_w_as_a_tpu_stores_it(monkeypatch, layout, match):
    """A TPU keeps a [256, 1000] argument column-major and [1000, 256] row-major
    (ops.core.tpu.row_major_by_default). With match_tpu_layout (the default) an "hv" head of
    that shape runs the "vh" kernels on W^T, so a TPU reads the parameter with no relayout;
    as given, it runs the "hv" kernels. Either way: the reference's loss and gradients."""
    seen = []
    real = pallas_tpu.head_statistics

    def spy(*args, **kw):
        seen.append(kw["layout"])
        return real(*args, **kw)

    monkeypatch.setattr(pallas_tpu, "head_statistics", spy)
    opts = dataclasses.replace(SMALL["pallas"], match_tpu_layout=match)
    cfg = GRPOLossConfig(beta=0.04, importance_sampling_level="sequence")
    assert_close("pallas", make_inputs(3, layout=layout, bias=True), cfg, layout, options=opts)
    assert seen == ["vh" if match or layout == "vh" else "hv"]


@pytest.mark.parametrize("layout", ["hv", "vh"])
def test_dweight_blocks_with_a_tail(monkeypatch, layout):
    """dW goes over blocks of its rows into an [H, V] accumulator (transposed once for "vh"):
    H = 256 in two full blocks of 104 rows and a tail of 48, with chunked rows and a bias."""
    monkeypatch.setattr(head_plan, "DWEIGHT_ELEMENTS", 104 * V + 7)
    assert head_plan.dweight_rows(H, V, "cpu") == 104
    cfg = GRPOLossConfig(beta=0.04)
    assert_close("xla", make_inputs(11, layout=layout, bias=True), cfg, layout)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("layout", ["hv", "vh"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_dweight_by_vocabulary_blocks(level, layout, bias):
    """dweight="vocab": dW and db from a pass over 128-column blocks (V = 1000: seven full
    blocks and a tail of 104), every token at once; token and sequence level."""
    cfg = GRPOLossConfig(beta=0.04, temperature=0.7, importance_sampling_level=level)
    blocks = LmHeadBlockSizes(chunk_tokens=8, chunk_bytes=128 * 32 * B * T, dweight="vocab")
    assert plan_vocab_block(B * T, V, blocks, "cpu") == 128
    assert_close("xla", make_inputs(14, layout=layout, bias=bias), cfg, layout, options=blocks)


def test_dweight_by_vocabulary_blocks_bf16_and_options():
    """The vocabulary pass in bf16 (within one rounding of the other mode, which the bf16 test
    checks against the reference) and under tunix's options with sampler weights."""
    cfg = GRPOLossConfig(beta=0.04, temperature=0.7)
    inputs = make_inputs(15, b=2, t=64, h=128, v=2048, dtype=jnp.bfloat16)
    _, _, by_tokens = run("xla", inputs, cfg)
    _, _, by_vocab = run("xla", inputs, cfg, options=LmHeadBlockSizes(dweight="vocab"))
    assert by_vocab[1].dtype == jnp.bfloat16
    assert rel_err(by_vocab[0], by_tokens[0]) == 0.0  # dh: the same token pass
    assert rel_err(by_vocab[1], by_tokens[1]) <= 2.0 ** -7
    cfg, _ = OPTIONS[-1]
    hidden, w, ids, mask, adv, extra, _ = make_inputs(16)
    extra = {**extra, "sampler_weights": jax.random.uniform(
        jax.random.PRNGKey(17), mask.shape, jnp.float32, 0.2, 2.0)}
    assert_close("xla", (hidden, w, ids, mask, adv, extra, None), cfg,
                 options=LmHeadBlockSizes(chunk_tokens=8, dweight="vocab"))


@pytest.mark.parametrize("layout", ["hv", "vh"])
def test_dweight_by_vocabulary_slabs_bf16(monkeypatch, layout):
    """16-bit dW goes through slabs of whole blocks (V = 1000, 128-column blocks, 3 slabs:
    384, 384 and a tail of 232 = 128 + 104): bit-identical to one slab, within one bf16
    rounding of dweight="tokens", db too."""
    cfg = GRPOLossConfig(beta=0.04, temperature=0.7)
    inputs = make_inputs(18, layout=layout, bias=True, dtype=jnp.bfloat16)
    blocks = LmHeadBlockSizes(chunk_tokens=8, chunk_bytes=128 * 32 * B * T, dweight="vocab")
    monkeypatch.setattr(xla_vocab, "DWEIGHT_SLABS", 3)
    _, _, three = run("xla", inputs, cfg, layout=layout, options=blocks)
    monkeypatch.setattr(xla_vocab, "DWEIGHT_SLABS", 1)
    _, _, one = run("xla", inputs, cfg, layout=layout, options=blocks)
    _, _, by_tokens = run("xla", inputs, cfg, layout=layout,
                          options=LmHeadBlockSizes(chunk_tokens=8))
    for a, b in zip(three, one, strict=True):
        assert a.dtype == b.dtype and bool(jnp.all(a == b))
    assert rel_err(three[1], by_tokens[1]) <= 2.0 ** -7
    assert rel_err(three[2], by_tokens[2]) <= 2.0 ** -7


@pytest.mark.parametrize("layout", ["hv", "vh"])
@pytest.mark.default_emitters
def test_dweight_by_vocabulary_holds_no_accumulator(layout):
    """Planned temporaries against the head's width (N = 512, V = 32768, bf16, H = 512 and
    1024): with dweight="tokens" they grow by the float32 accumulator's 4 bytes per weight;
    by vocabulary blocks by at most two of the eight bf16 slabs (plus 10%): no weight-sized
    buffer, neither an integer view of W nor a whole dW written through one."""
    spec = jax.ShapeDtypeStruct
    b, t, v = 2, 256, 32768
    cfg = GRPOLossConfig(beta=0.04)
    ids, mask = jnp.zeros((b, t), jnp.int32), jnp.ones((b, t))
    old, adv = jnp.zeros((b, t)), jnp.ones((b,))

    def temp_bytes(mode, h):
        def f(hh, ww):
            return grpo_loss_from_hidden(hh, ww, ids, mask, adv, config=cfg, impl="xla",
                                         old_logps=old, ref_logps=old,
                                         options=LmHeadBlockSizes(dweight=mode),
                                         lm_head_layout=layout)
        step = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
        compiled = step.lower(spec((b, t, h), jnp.bfloat16),
                              spec((h, v) if layout == "hv" else (v, h), jnp.bfloat16)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    weights = (1024 - 512) * v
    by_tokens = temp_bytes("tokens", 1024) - temp_bytes("tokens", 512)
    by_vocab = temp_bytes("vocab", 1024) - temp_bytes("vocab", 512)
    assert by_tokens >= 4 * weights, by_tokens / weights
    assert by_vocab <= 1.1 * 2 * 2 / xla_vocab.DWEIGHT_SLABS * weights, by_vocab / weights


def test_delta_dtype_is_the_narrower():
    bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
    assert delta_dtype(f32, bf16) == bf16  # an f32 head on bf16 operands: bf16 matmuls
    assert delta_dtype(bf16, f32) == bf16
    assert delta_dtype(f32, f32) == f32
    assert delta_dtype(bf16, bf16) == bf16


def test_on_policy_and_dapo_num_items():
    cfg = GRPOLossConfig(loss_type="dapo")
    hidden, w, ids, mask, adv, _, _ = make_inputs(4)
    inputs = (hidden, w, ids, mask, adv, {"num_items_in_batch": 40.0}, None)
    assert_close("xla", inputs, cfg)


def test_f32_error_at_a_larger_shape():
    """The f32 gate (rel err of dhidden and dW <= 1e-5) with real chunking."""
    cfg = GRPOLossConfig(beta=0.04)
    assert_close("xla", make_inputs(5, b=2, t=160, h=128, v=4099), cfg,
                 options=LmHeadBlockSizes(chunk_tokens=64))


def test_bf16_within_one_rounding_of_the_logits():
    """bf16: the fused op rounds every logit to bf16 exactly once, as declared; XLA may keep
    the reference's logits in float32 (excess precision). One rounding moves a logit by at most
    2^-9 |z|, so logp by at most 2^-8 max|z| / tau, and the gradients (relative to their max)
    by about 2^-8 (1 + max|z| / tau), the dlogits' own bf16 rounding included."""
    cfg = GRPOLossConfig(beta=0.04, temperature=0.7)
    inputs = make_inputs(6, b=2, t=64, h=128, v=2048, dtype=jnp.bfloat16)
    hidden, w = inputs[:2]
    zmax = float(jnp.max(jnp.abs(jnp.einsum("bth,hv->btv", hidden.astype(jnp.float32),
                                            w.astype(jnp.float32)))))
    bound = 2.0 ** -8 * (1 + zmax / cfg.temperature)
    loss_r, m_r, g_r = run("reference", inputs, cfg)
    for impl in ("xla", "pallas"):
        loss_k, m_k, g_k = run(impl, inputs, cfg)
        assert g_k[0].dtype == jnp.bfloat16 and g_k[1].dtype == jnp.bfloat16
        lp_err = np.max(np.abs(as64(m_k["logp"]) - as64(m_r["logp"])))
        assert lp_err <= 2.0 ** -8 * zmax / cfg.temperature + 1e-5, (impl, lp_err)
        for a, b in zip(g_k[:2], g_r[:2]):
            assert rel_err(a, b) <= bound, (impl, rel_err(a, b), bound)


def test_f32_head_and_mixed_dtypes():
    """logits_dtype=float32 with bf16 inputs (an f32 head), and bf16 hidden with f32 W."""
    cfg = GRPOLossConfig(beta=0.04)
    hidden, w, ids, mask, adv, extra, _ = make_inputs(7, dtype=jnp.bfloat16)
    # Gradients come out in bf16: one rounding of the output (2^-8 relative) is the tolerance.
    assert_close("xla", (hidden, w, ids, mask, adv, extra, None), cfg, tol=2.0 ** -7,
                 logits_dtype=jnp.float32)
    mixed = (hidden, w.astype(jnp.float32), ids, mask, adv, extra, None)
    _, _, grads = run("xla", mixed, cfg)
    assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.float32
    assert_close("xla", mixed, cfg, tol=2.0 ** -7)


def test_value_without_gradient_matches():
    cfg = GRPOLossConfig(beta=0.04)
    hidden, w, ids, mask, adv, extra, _ = make_inputs(8)
    values = [float(jax.jit(lambda h, ww, impl=impl: grpo_loss_from_hidden(
        h, ww, ids, mask, adv, config=cfg, impl=impl, **extra)[0])(hidden, w))
        for impl in ("reference", "xla", "pallas")]
    np.testing.assert_allclose(values[1:], [values[0]] * 2, rtol=1e-5)


def _temp_bytes(impl, n_tokens, vocab=4096, hidden=256, dtype=jnp.float32, beta=0.04,
                chunk_tokens=128):
    """Compiled temp bytes of value_and_grad with the metrics kept; ``chunk_tokens=None``: the
    xla op plans its own chunks."""
    cfg = GRPOLossConfig(beta=beta)
    spec = jax.ShapeDtypeStruct
    b, t = 2, n_tokens // 2
    args = (spec((b, t, hidden), dtype), spec((hidden, vocab), dtype))
    ids, mask = jnp.zeros((b, t), jnp.int32), jnp.ones((b, t))
    old, adv = jnp.zeros((b, t)), jnp.ones((b,))
    blocks = LmHeadBlockSizes(chunk_tokens=chunk_tokens) if impl == "xla" else None

    def f(h, w):
        return grpo_loss_from_hidden(h, w, ids, mask, adv, config=cfg, impl=impl,
                                     old_logps=old, ref_logps=old if beta else None,
                                     options=blocks)

    step = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
    return step.lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.default_emitters
def test_temp_memory_is_independent_of_tokens():
    """Planned temporaries: O(chunk x V) (plus O(N H) for dhidden), never O(N V)."""
    small, large = _temp_bytes("xla", 512), _temp_bytes("xla", 4096)
    n_h_bytes = (4096 - 512) * 256 * 4 * 2  # hidden-sized buffers may grow with N
    assert large - small <= n_h_bytes, (small, large)
    ref = _temp_bytes("reference", 4096)
    assert large <= 0.1 * ref, (large, ref)


@pytest.mark.default_emitters
def test_bf16_temps_at_the_benchmark_shape():
    """The memory gate of the fused head where its benchmark runs (N = 2048, H = 512, V = 32768, bf16,
    planned chunks, metrics kept): temporaries <= 0.10 x the reference's. Compile-only."""
    fused, ref = (_temp_bytes(impl, 2048, vocab=32768, hidden=512, dtype=jnp.bfloat16, beta=0.0,
                              chunk_tokens=None) for impl in ("xla", "reference"))
    assert fused <= 0.10 * ref, (fused, ref, fused / ref)


def test_round_to_bfloat16_matches_astype_bit_for_bit():
    """Veltkamp's split equals astype(bfloat16) on random bit patterns, every tie (low half
    0x8000) and its neighbours; infinities, NaN and huge values pass unchanged."""
    rng = np.random.default_rng(11)
    bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    high = bits & np.uint32(0xFFFF0000)
    x = np.concatenate([bits] + [high | np.uint32(d) for d in (0x7FFF, 0x8000, 0x8001)]
                       ).view(np.float32)
    ours = np.asarray(jax.jit(xla_sweep.round_to_bfloat16)(x))
    want = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    normal = np.isfinite(x) & (np.abs(x) >= np.finfo(np.float32).tiny) & (np.abs(x) < 2.0**100)
    assert normal.sum() > 300_000
    np.testing.assert_array_equal(ours[normal].view(np.uint32), want[normal].view(np.uint32))
    assert (ours[normal] != x[normal]).mean() > 0.9  # it did round
    passed = ~normal & ~np.isnan(x) & (np.abs(x) >= np.finfo(np.float32).tiny)
    np.testing.assert_array_equal(ours[passed], x[passed])
    assert np.isnan(ours[np.isnan(x)]).all()


@pytest.mark.parametrize("block", [None, 96, 1000])
def test_chunk_stats_blocks_match_whole_rows(block):
    """Statistics over vocabulary blocks (a tail included) equal a float64 oracle, with -inf
    columns (a bias that masks tokens) and a block that is all -inf in one row."""
    rng = np.random.default_rng(5)
    s = rng.normal(size=(6, 1000)) * 3.0
    s[:, rng.choice(1000, 300, replace=False)] = -np.inf
    s[2, :200] = -np.inf
    m, total, q = jax.jit(lambda x: xla_sweep.chunk_stats(x, block))(jnp.asarray(s, jnp.float32))
    m64 = s.max(axis=1, keepdims=True)
    e = np.exp(s - m64)
    lse = (m64 + np.log(e.sum(axis=1, keepdims=True)))[:, 0]
    with np.errstate(invalid="ignore"):  # -inf - lse is fine; the where drops those terms
        terms = np.exp(s - lse[:, None]) * (s - lse[:, None])
    ent = -np.sum(np.where(e > 0, terms, 0.0), axis=1)
    got_lse = np.asarray(m) + np.log(np.asarray(total))
    got_ent = np.log(np.asarray(total)) - np.asarray(q) / np.asarray(total)
    np.testing.assert_allclose(got_lse, lse, rtol=1e-6)
    np.testing.assert_allclose(got_ent, ent, rtol=1e-5)


def test_plan_chunk():
    assert [head_plan.dweight_rows(4096, 151_936, k) for k in ("cpu", "gpu", "tpu")] == [
        24, 4096, 512]
    assert head_plan.dweight_rows(256, 151_936, "tpu") == 256
    assert plan_chunk(4096, 32768, LmHeadBlockSizes(), "cpu") == 256
    assert plan_chunk(100, 32768, LmHeadBlockSizes(chunk_tokens=300), "cpu") == 100
    assert plan_chunk(10**6, 10**7, LmHeadBlockSizes(), "cpu") == 8
    # GPU: 1 GiB over 4 V bytes (1764 rows at V = 151,936), down to a power of two
    assert plan_chunk(8192, 151_936, LmHeadBlockSizes(), "gpu") == 1024
    assert plan_chunk(1000, 151_936, LmHeadBlockSizes(), "gpu") == 1000
    assert plan_chunk(8192, 151_936, LmHeadBlockSizes(chunk_bytes=100 << 20), "gpu") == 128
    assert plan_vocab_block(8192, 151_936, LmHeadBlockSizes(), "cpu") == 128
    assert plan_vocab_block(512, 151_936, LmHeadBlockSizes(), "cpu") == 2048
    assert plan_vocab_block(8, 1000, LmHeadBlockSizes(), "cpu") == 1000


@pytest.mark.parametrize("kwargs,match", [
    (dict(lm_head_layout="hw"), "lm_head_layout must be one of"),
    (dict(w_shape=(V, H)), r"lm_head with lm_head_layout='hv' must have shape \[H, V\]"),
    (dict(w_shape=(H, V), lm_head_layout="vh"), r"must have shape \[V, H\]"),
    (dict(w_shape=(H, V, 1)), "lm_head must have rank 2"),
    (dict(bias_shape=(V + 1,)), r"bias must have shape \[V\]"),
    (dict(hidden_shape=(B, T)), "hidden must have rank 3"),
    (dict(hidden_dtype=jnp.int32), "hidden must be bfloat16, float16 or float32"),
    (dict(logits_dtype="int8"), "logits_dtype must be None, bfloat16"),
    (dict(impl="triton"), "impl must be one of"),
    (dict(ids_shape=(B, T + 1)), r"ids must have shape \[B, T\]"),
    (dict(options=LmHeadPallasOptions()), "options must be LmHeadBlockSizes"),
    (dict(config=GRPOLossConfig(sampler_correction="sequence_mask")),
     r"sampler_logps \[B, T\] .* is required when config.sampler_correction"),
    (dict(sampler_logps=jnp.ones((B, T, 1))), r"sampler_logps must have shape \[B, T\]"),
])
def test_bad_input_names_the_argument(kwargs, match):
    kwargs = dict(kwargs)
    hidden = jnp.ones(kwargs.pop("hidden_shape", (B, T, H)), kwargs.pop("hidden_dtype",
                                                                         jnp.float32))
    w = jnp.ones(kwargs.pop("w_shape", (H, V)))
    bias_shape = kwargs.pop("bias_shape", None)
    bias = None if bias_shape is None else jnp.ones(bias_shape)
    ids = jnp.zeros(kwargs.pop("ids_shape", (B, T)), jnp.int32)
    kwargs.setdefault("impl", "xla")
    config = kwargs.pop("config", GRPOLossConfig())
    with pytest.raises(ValueError, match=match):
        grpo_loss_from_hidden(hidden, w, ids, jnp.ones((B, T)), jnp.ones((B,)),
                              config=config, bias=bias, **kwargs)


def test_block_sizes_validation():
    with pytest.raises(ValueError, match=r"LmHeadBlockSizes.dweight must be one of \('tokens'"):
        LmHeadBlockSizes(dweight="rows")
    with pytest.raises(ValueError, match="LmHeadBlockSizes.chunk_tokens"):
        LmHeadBlockSizes(chunk_tokens=0)


def test_pallas_options_validation():
    with pytest.raises(ValueError, match="LmHeadPallasBlockSizes.block_vocab must be a multiple of 128"):
        LmHeadPallasBlockSizes(block_vocab=200)
    with pytest.raises(ValueError, match="LmHeadPallasBlockSizes.block_rows must be a multiple of 16"):
        LmHeadPallasBlockSizes(block_rows=8)
    with pytest.raises(ValueError, match="LmHeadPallasOptions.vmem_limit_bytes"):
        LmHeadPallasOptions(vmem_limit_bytes=0)
    with pytest.raises(ValueError, match="LmHeadPallasOptions.blocks must be None or an"):
        LmHeadPallasOptions(blocks=LmHeadBlockSizes())
    with pytest.raises(ValueError, match="LmHeadPallasOptions.interpret"):
        LmHeadPallasOptions(interpret="no")
    with pytest.raises(ValueError, match="LmHeadPallasOptions.match_tpu_layout must be a bool"):
        LmHeadPallasOptions(match_tpu_layout="auto")
    with pytest.raises(ValueError, match="must divide H"):
        pallas_tpu.plan_tiles(64, 384, 1000, LmHeadPallasOptions(
            blocks=LmHeadPallasBlockSizes(block_hidden=256)))


def test_compiled_pallas_head_on_a_gpu_says_it_has_tpu_kernels_only(monkeypatch):
    """On a GPU host the Mosaic kernels would fail inside Triton's lowering; the op says why
    first. Interpret mode, or a named tpu_generation (tracing for a TPU), still traces."""
    monkeypatch.setattr(pallas_options, "backend_kind", lambda backend=None: "gpu")
    hidden, w, ids, mask, adv, extra, _ = make_inputs(0)

    def trace(options):
        return jax.eval_shape(lambda hh, ww: grpo_loss_from_hidden(
            hh, ww, ids, mask, adv, config=GRPOLossConfig(), impl="pallas", options=options,
            **extra), hidden, w)

    with pytest.raises(ValueError, match="fused head has TPU kernels only; on a GPU use "
                                         "impl='xla'"):
        trace(LmHeadPallasOptions(interpret=False))
    for ok in (LmHeadPallasOptions(interpret=True),
               LmHeadPallasOptions(interpret=False, tpu_generation="v6e")):
        loss, _ = trace(ok)
        assert loss.shape == ()


@pytest.mark.parametrize("layout", ["hv", "vh"])
def test_tpu_kernels_lower_at_the_real_shape(layout):
    """value_and_grad at B*T = 8192, H = 4096, V = 151,936, bf16 lowers to three Mosaic kernels
    (the tied ``"vh"`` head with Gemma 2's soft cap of 30)."""
    cfg = GRPOLossConfig(beta=0.04)
    b, t, h, v = 1, 8192, 4096, 151_936
    spec = jax.ShapeDtypeStruct
    w_shape = (h, v) if layout == "hv" else (v, h)
    args = (spec((b, t, h), jnp.bfloat16), spec(w_shape, jnp.bfloat16),
            spec((b, t), jnp.int32), spec((b, t), jnp.float32), spec((b,), jnp.float32),
            spec((b, t), jnp.float32), spec((b, t), jnp.float32))

    def f(hidden, w, ids, mask, adv, old, ref):
        return grpo_loss_from_hidden(hidden, w, ids, mask, adv, config=cfg, impl="pallas",
                                     old_logps=old, ref_logps=ref, lm_head_layout=layout,
                                     logit_softcap=30.0 if layout == "vh" else None,
                                     options=LmHeadPallasOptions(interpret=False))

    step = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
    with every_platform():
        exported = jax.export.export(step, platforms=["tpu"])(*args)
    assert exported.mlir_module().count("tpu_custom_call") == 3
    dh, dw = exported.out_avals[-2:]
    assert dh.shape == (b, t, h) and dh.dtype == jnp.bfloat16
    assert dw.shape == w_shape and dw.dtype == jnp.bfloat16


def test_xla_lowered_for_an_accelerator_keeps_none_of_the_cpu_workarounds():
    """Lowered for a TPU or GPU, the fused head has none of the CPU's plan: bfloat16 casts by
    integer arithmetic, statistics over 4096-column blocks, dW in row blocks (loops). The
    choice follows the lowering platform, not the tracing host (a TPU compile on a CPU host
    planned the CPU's program before)."""
    cfg = GRPOLossConfig(beta=0.04)
    hidden, w, ids, mask, adv, extra, _ = make_inputs(33, t=16, v=8192 + 5, dtype=jnp.bfloat16)

    def grads(hh, ww):
        return jax.grad(lambda hh, ww: grpo_loss_from_hidden(
            hh, ww, ids, mask, adv, config=cfg, impl="xla", **extra)[0], argnums=(0, 1))(hh, ww)

    text = {p: lowered_text(grads, hidden, w, platform=p) for p in ("cpu", "tpu", "cuda")}
    assert "shift_right" in text["cpu"]
    for platform in ("tpu", "cuda"):
        assert "shift_right" not in text[platform], platform
        assert text[platform].count("stablehlo.while") < text["cpu"].count("stablehlo.while")


@pytest.mark.parametrize("kind,dtype,dweight", [("tpu", jnp.float32, "tokens"),
                                                ("gpu", jnp.bfloat16, "vocab")])
def test_xla_accelerator_plan_matches_reference(monkeypatch, kind, dtype, dweight):
    """The branch a GPU or TPU lowering keeps (whole-row statistics, dW in blocks of TPU rows
    or all of its rows per update on GPU, a plain bfloat16 cast), run on this CPU, at both
    sequence and token level."""
    take_plan_of(monkeypatch, head_xla, kind)
    monkeypatch.setattr(head_plan, "TPU_DWEIGHT_ROWS", 96)  # H = 256: 96 + 96 + a tail of 64
    assert head_plan.dweight_rows(H, V, kind) == (96 if kind == "tpu" else H)
    opts = LmHeadBlockSizes(chunk_tokens=8, dweight=dweight)
    tol = 1e-5 if dtype == jnp.float32 else 2.0 ** -6
    for level in ("token", "sequence"):
        cfg = GRPOLossConfig(beta=0.04, importance_sampling_level=level, temperature=0.8)
        inputs = make_inputs(34, dtype=dtype, scale=1.0)
        assert_close("xla", inputs, cfg, tol=tol, options=opts)
