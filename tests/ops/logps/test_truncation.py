"""Log-probs under a sampler's top-k, top-p and min-p: the float64 oracle that sorts each row
(tests/oracle.py) checks the floors, the reference and every path that truncates (values,
entropies, which tokens lie outside, gradients), on rows with ties; the XLA paths plan no
float32 ``[B, T, V]``; bad options are named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_kernels import (LmHeadBlockSizes, PallasOptions, XlaBlockSizes, token_logps,
                          token_logps_from_head_fn, token_logps_from_hidden)
from grpo_kernels.ops.core.truncation import Truncation, listed_stats, support_floor
from tests.helpers import rel_err
from tests.oracle import truncated_oracle

TAU = 0.7
# Each option alone, the three together, and top-p without top-k (the bisection); top-k 1.
TRUNCATIONS = [Truncation(top_k=20), Truncation(top_p=0.8), Truncation(min_p=0.05),
               Truncation(top_k=50, top_p=0.95, min_p=0.02), Truncation(top_p=0.5, min_p=0.01),
               Truncation(top_k=1)]


def _tid(tr):
    return "-".join(f"{k}{v}" for k, v in vars(tr).items() if v is not None)


def _rows(seed, n, v):
    """Scaled logits with ties: a block of equal values at the top of row 0, every row after
    the first rounded to a tenth (ties everywhere, the k-th value and the top-p boundary
    among them)."""
    s = 3 * np.random.default_rng(seed).normal(size=(n, v)).astype(np.float32)
    s[0, :40] = s[0].max()
    s[1:] = np.round(s[1:], 1)
    return s


@pytest.mark.parametrize("v", [300, 1513, 151_936])
def test_floors_keep_what_the_oracle_keeps(v):
    """Both ways to the floor (top_k/bisection, and sorting) keep exactly the oracle's set;
    under a top-k, the statistics from the k largest values (listed_stats) are the oracle's
    too, ties at the k-th beyond the list included."""
    n = 2 if v > 10_000 else 6
    s = _rows(v, n, v)
    s[-1, :60] = np.sort(s[-1])[-30]  # 60 ties at about the 30th largest: past any top-k here
    ids = np.random.default_rng(v).integers(0, v, n)
    for tr in TRUNCATIONS:
        logp, ent, kept, outside, _ = truncated_oracle(s, ids, tr.top_k, tr.top_p, tr.min_p)
        for by_sorting in (False, True):
            f = jax.jit(lambda x: support_floor(x, tr, by_sorting))(jnp.asarray(s))
            np.testing.assert_array_equal(s >= np.asarray(f)[:, None], kept,
                                          err_msg=f"{tr} by_sorting={by_sorting}")
        if tr.top_k is not None:
            chosen = jnp.asarray(s[np.arange(n), ids])
            f, lp, _, h, out = jax.jit(lambda x, c: listed_stats(x, c, tr))(jnp.asarray(s),
                                                                            chosen)
            np.testing.assert_array_equal(s >= np.asarray(f)[:, None], kept, err_msg=str(tr))
            np.testing.assert_allclose(np.asarray(lp), logp, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(np.asarray(h), ent, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(np.asarray(out), outside)


def _check(got, want, grad_got, grad_want, outside_want):
    logp, ent, outside = got
    np.testing.assert_allclose(np.asarray(logp), want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), want[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(outside), outside_want)
    assert np.isfinite(np.asarray(grad_got)).all()
    assert rel_err(grad_got, grad_want) <= 1e-5


def _oracle_of(s, ids, tr):
    """Oracle log-probs, entropies, outside flags and the gradient of ``sum(logp * w)``
    w.r.t. the scaled logits (``w``: fixed weights per token)."""
    n, v = s.shape
    logp, ent, _, outside, dlogp = truncated_oracle(s, ids, tr.top_k, tr.top_p, tr.min_p)
    return (logp, ent), outside, dlogp


# Every truncation through xla, the logits' dtype alternating; the reference (whose floors
# test_floors checks) with the three options together; the Pallas gradient kernels (TPU, and
# the GPU's "rows" layout) under the XLA pass's floors, with top-k and with the bisection.
CASES = [("xla", tr, ("float32", "bfloat16")[i % 2]) for i, tr in enumerate(TRUNCATIONS)] + [
    ("reference", TRUNCATIONS[3], "bfloat16"), ("pallas", TRUNCATIONS[3], "float32"),
    ("pallas-gpu", TRUNCATIONS[4], "bfloat16")]
HEAD_CASES = [("xla", tr, ("tokens", "vocab")[i % 2]) for i, tr in enumerate(TRUNCATIONS)] + [
    ("reference", TRUNCATIONS[3], "tokens"), ("function", TRUNCATIONS[3], "tokens"),
    ("pallas", TRUNCATIONS[4], "tokens")]
# impl name in the cases -> (impl, options) of the logits ops
LOGITS_IMPLS = {"xla": ("xla", XlaBlockSizes(chunk_tokens=3, block_vocab=128)),
                "reference": ("reference", None), "pallas": ("pallas", None),
                "pallas-gpu": ("pallas", PallasOptions(kernel="gpu"))}


@pytest.mark.parametrize("impl,tr,dtype", CASES,
                         ids=[f"{i}-{_tid(t)}-{d}" for i, t, d in CASES])
def test_logits_path_equals_the_oracle(impl, tr, dtype):
    """token_logps on ``[B, T, V]`` logits, V = 300, with ties; a few chosen ids outside the
    kept set (drawn uniformly, most fall outside a top-20)."""
    b, t, v = 2, 5, 300
    s = _rows(7, b * t, v).reshape(b, t, v)
    z = jnp.asarray(s * TAU, jnp.dtype(dtype))
    s64 = np.asarray(z.astype(jnp.float32), np.float64) / TAU
    ids = jnp.asarray(np.random.default_rng(8).integers(0, v, (b, t)))
    ids = ids.at[0, :2].set(jnp.argmax(z[0, :2], -1))  # some inside for sure
    w = jnp.asarray(np.random.default_rng(9).normal(size=(b, t)), jnp.float32)
    impl, opts = LOGITS_IMPLS[impl]

    def f(z):
        logp, ent, outside = token_logps(z, ids, temperature=TAU, impl=impl, options=opts,
                                         return_entropy=True, return_outside=True,
                                         top_k=tr.top_k, top_p=tr.top_p, min_p=tr.min_p)
        return jnp.sum(logp * w), (logp, ent, outside)

    (_, got), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(z)
    want, outside, dlogp = _oracle_of(s64.reshape(b * t, v), np.asarray(ids).reshape(-1), tr)
    want = tuple(x.reshape(b, t) for x in want)
    grad_want = (dlogp * np.asarray(w).reshape(-1, 1) / TAU).reshape(b, t, v)
    if dtype == "bfloat16":  # the gradient comes back in the logits' dtype
        grad_want = np.asarray(jnp.asarray(grad_want, jnp.bfloat16).astype(jnp.float32))
        assert rel_err(grad.astype(jnp.float32), grad_want) <= 1e-2
        grad = grad_want
    _check(got, want, grad, grad_want, outside.reshape(b, t))


@pytest.mark.parametrize("impl,tr,dweight", HEAD_CASES,
                         ids=[f"{i}-{_tid(t)}-{d}" for i, t, d in HEAD_CASES])
def test_hidden_path_equals_the_oracle(impl, tr, dweight):
    """token_logps_from_hidden: the floors found inside the head's token chunks, gradients
    w.r.t. the hidden states and the head (both ``dweight`` modes) from the oracle's; and
    token_logps_from_head_fn (``impl="function"``: the head as a function, three chunks of
    two positions, one of them padded)."""
    b, t, hdim, v = 2, 5, 16, 300
    k1, k2 = jax.random.split(jax.random.key(3))
    h = jax.random.normal(k1, (b, t, hdim))
    w_head = 0.5 * jax.random.normal(k2, (hdim, v))  # logits of std 2: many tokens count
    ids = jnp.asarray(np.random.default_rng(4).integers(0, v, (b, t)))
    wts = jnp.asarray(np.random.default_rng(5).normal(size=(b, t)), jnp.float32)
    opts = LmHeadBlockSizes(chunk_tokens=4, dweight=dweight) if impl == "xla" else None

    def f(h, w_head):
        kw = dict(temperature=TAU, return_entropy=True, return_outside=True, top_k=tr.top_k,
                  top_p=tr.top_p, min_p=tr.min_p)
        if impl == "function":
            logp, ent, outside = token_logps_from_head_fn(
                h, lambda x: x @ w_head, ids, blocks=LmHeadBlockSizes(chunk_tokens=4), **kw)
        else:
            logp, ent, outside = token_logps_from_hidden(h, w_head, ids, impl=impl,
                                                         options=opts, **kw)
        return jnp.sum(logp * wts), (logp, ent, outside)

    (_, got), (dh, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(h, w_head)
    z64 = np.einsum("bth,hv->btv", np.asarray(h, np.float64), np.asarray(w_head, np.float64))
    want, outside, dlogp = _oracle_of(z64.reshape(b * t, v) / TAU,
                                      np.asarray(ids).reshape(-1), tr)
    dz = dlogp * np.asarray(wts).reshape(-1, 1) / TAU
    h64 = np.asarray(h, np.float64).reshape(b * t, hdim)
    dh_want = (dz @ np.asarray(w_head, np.float64).T).reshape(b, t, hdim)
    _check(got, tuple(x.reshape(b, t) for x in want), dh, dh_want, outside.reshape(b, t))
    assert rel_err(dw, h64.T @ dz) <= 1e-5


def test_nothing_dropped_is_the_plain_log_prob():
    """Options that drop nothing (top-k >= V, top-p 1, min-p 0) give the untruncated log-probs
    and no token outside."""
    z = jax.random.normal(jax.random.key(0), (2, 3, 50))
    ids = jnp.array([[1, 2, 3], [4, 5, 49]])
    plain = token_logps(z, ids, impl="xla")
    got, outside = token_logps(z, ids, impl="xla", top_k=50, top_p=1.0, min_p=0.0,
                               return_outside=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))
    assert not bool(outside.any())


@pytest.mark.parametrize("fn", ["logits", "hidden"])
@pytest.mark.default_emitters
def test_xla_plans_no_float32_logits(fn):
    """Compiled at Qwen's V = 151,936 (B=1, T=512): top-k 50 with top-p 0.95 on the XLA paths
    plans less than one float32 ``[B, T, V]`` of temporaries."""
    b, t, v, hdim = 1, 512, 151_936, 256
    ids = jax.ShapeDtypeStruct((b, t), jnp.int32)
    kw = dict(top_k=50, top_p=0.95, impl="xla", temperature=TAU)
    if fn == "logits":
        z = jax.ShapeDtypeStruct((b, t, v), jnp.bfloat16)
        step = jax.jit(jax.grad(lambda z, i: jnp.sum(token_logps(z, i, **kw))))
        args = (z, ids)
    else:
        h = jax.ShapeDtypeStruct((b, t, hdim), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((hdim, v), jnp.bfloat16)
        step = jax.jit(jax.grad(lambda h, w, i: jnp.sum(token_logps_from_hidden(
            h, w, i, **kw)), argnums=(0, 1)))
        args = (h, w, ids)
    temp = step.lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert temp < 4 * b * t * v, temp


@pytest.mark.parametrize("kw,match", [
    (dict(top_k=0), "top_k must be None or an int >= 1"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), r"top_p must be None or a number in \(0, 1\]"),
    (dict(top_p=1.5), "top_p"),
    (dict(min_p=-0.1), r"min_p must be None or a number in \[0, 1\]"),
    (dict(min_p=float("nan")), "min_p"),
    (dict(top_k=5, impl="pallas", options=PallasOptions(kernel="gpu", gpu_layout="aligned")),
     "gpu_layout='aligned' takes no truncation floor"),
    (dict(top_k=5, return_outside=1), "return_outside must be a bool"),
])
def test_bad_options_are_named(kw, match):
    z = jnp.ones((1, 2, 8))
    with pytest.raises(ValueError, match=match):
        token_logps(z, jnp.zeros((1, 2), jnp.int32), **kw)


# The losses: GRPOLossConfig's top_k / top_p / min_p, xla against the reference (whose log-probs
# the oracle checks here), token level (the fused head's one pass) and sequence level (its two
# passes), both dweight modes, values, the outside count and gradients; the Pallas kernels
# (logits: TPU or GPU; the TPU head) in two of them, token level (where the TPU would take its
# one-pass kernel, which takes no floor) with an entropy bonus, and sequence level.
# The last case: the fused head's entropy-quantile pass (its estimate from 3 of 24 rows, so that
# its correction revisits rows: 6 here, whose gradients are 45% off without the floors) with
# an entropy bonus, every step on the truncated distribution.
LOSS_CASES = [("token", TRUNCATIONS[3], "vocab", "tpu"),
              ("sequence", TRUNCATIONS[1], "vocab", None),
              ("sequence", TRUNCATIONS[0], "tokens", "gpu"),
              ("quantile", TRUNCATIONS[4], "tokens", None)]


@pytest.mark.parametrize("level,tr,dweight,kernel", LOSS_CASES,
                         ids=[f"{lv}-{_tid(t)}-{d}-{k}" for lv, t, d, k in LOSS_CASES])
def test_losses_take_the_truncation(monkeypatch, level, tr, dweight, kernel):
    from grpo_kernels import GRPOLossConfig, grpo_loss, grpo_loss_from_hidden
    from grpo_kernels.ops.lm_head_loss import xla_quantile

    b, t, hdim, v = 2, 5, 16, 300
    quantile = dict(entropy_coef=0.05) if kernel == "tpu" else {}
    if level == "quantile":
        monkeypatch.setattr(xla_quantile, "SAMPLE_ROWS", 3)
        level, quantile = "token", dict(top_entropy_quantile=0.4, entropy_coef=0.05)
        t = 12
    cfg = GRPOLossConfig(importance_sampling_level=level, beta=0.04, temperature=TAU,
                         top_k=tr.top_k, top_p=tr.top_p, min_p=tr.min_p, **quantile)
    k = jax.random.split(jax.random.key(11), 5)
    h = jax.random.normal(k[0], (b, t, hdim))
    w_head = 0.5 * jax.random.normal(k[1], (hdim, v))
    ids = jnp.asarray(np.random.default_rng(12).integers(0, v, (b, t)))
    mask = jnp.ones((b, t)).at[1, 4].set(0.0)
    adv = jax.random.normal(k[2], (b,))
    old = -3.0 + 0.3 * jax.random.normal(k[3], (b, t))
    ref = -3.0 + 0.3 * jax.random.normal(k[4], (b, t))
    kw = dict(old_logps=old, ref_logps=ref)

    def logits_loss(z, impl):
        opts = {"xla": XlaBlockSizes(chunk_tokens=3),
                "pallas": kernel and PallasOptions(kernel=kernel)}.get(impl)
        return grpo_loss(z, ids, mask, adv, config=cfg, impl=impl, options=opts, **kw)

    def head_loss(h, w, impl):
        opts = LmHeadBlockSizes(chunk_tokens=4, dweight=dweight) if impl == "xla" else None
        return grpo_loss_from_hidden(h, w, ids, mask, adv, config=cfg, impl=impl,
                                     options=opts, **kw)

    z = jnp.einsum("bth,hv->btv", h, w_head)
    want = {}
    for impl in ("reference", "xla") + (("pallas",) if kernel else ()):
        (loss, m), g = jax.jit(jax.value_and_grad(lambda z: logits_loss(z, impl),
                                                  has_aux=True))(z)
        (hloss, hm), hg = jax.jit(jax.value_and_grad(lambda h, w: head_loss(h, w, impl),
                                                     argnums=(0, 1), has_aux=True))(h, w_head)
        got = (loss, m["logp"], m["outside_truncation"], g, hloss, hm["logp"],
               hm["outside_truncation"], *hg)
        for x in got:
            assert np.isfinite(np.asarray(x)).all()
        want.setdefault("reference", got)
        for i, (a, r) in enumerate(zip(got, want["reference"])):
            assert rel_err(a, r) <= 1e-5, (impl, i, rel_err(a, r))
    logp, _, _, outside, _ = truncated_oracle(np.asarray(z, np.float64).reshape(b * t, v) / TAU,
                                              np.asarray(ids).reshape(-1), tr.top_k, tr.top_p,
                                              tr.min_p)
    np.testing.assert_allclose(np.asarray(want["reference"][1]).reshape(-1), logp, rtol=1e-5,
                               atol=1e-5)
    assert float(want["reference"][2]) == (outside.reshape(b, t) * np.asarray(mask)).sum() > 0


def test_pallas_options_without_a_floor_are_refused_by_name():
    """The Pallas kernels that take no truncation floor (the one-pass kernels, the GPU's
    "aligned" layout), asked for by name with a truncation, raise a ValueError that names the
    option (also on a mesh); their defaults take the kernels that do."""
    from grpo_kernels import GRPOLossConfig, grpo_loss
    from grpo_kernels.sharding import ShardingSpec, sharded_grpo_loss

    cfg = GRPOLossConfig(top_k=5)
    z, ids = jax.random.normal(jax.random.key(0), (2, 3, 40)), jnp.zeros((2, 3), jnp.int32)
    mask, adv = jnp.ones((2, 3)), jnp.ones((2,))
    one_pass = PallasOptions(one_pass=True)
    with pytest.raises(ValueError, match="PallasOptions.one_pass=True takes no top_k"):
        grpo_loss(z, ids, mask, adv, config=cfg, impl="pallas", options=one_pass)
    with pytest.raises(ValueError, match="gpu_layout='aligned' takes no truncation floor"):
        grpo_loss(z, ids, mask, adv, config=cfg, impl="pallas",
                  options=PallasOptions(kernel="gpu", gpu_layout="aligned"))
    mesh = jax.make_mesh((1,), ("dp",))
    with pytest.raises(ValueError, match="PallasOptions.one_pass=True takes no top_k"):
        sharded_grpo_loss(z, ids, mask, adv, mesh=mesh, sharding=ShardingSpec("dp"),
                          config=cfg, impl="pallas", options=one_pass)
    _, m = grpo_loss(z, ids, mask, adv, config=cfg)  # auto
    fifth = np.sort(np.asarray(z), axis=-1)[..., -5]
    assert float(m["outside_truncation"]) == float((np.asarray(z)[..., 0] < fifth).sum())
