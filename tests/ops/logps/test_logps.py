"""``token_logps`` and ``token_logps_from_hidden``: a float64 oracle checks the reference, the
reference checks every implementation (values and gradients), no ``[B, T, V]`` where none is
promised, and bad arguments are named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_kernels import (
    LmHeadBlockSizes,
    LmHeadPallasBlockSizes,
    LmHeadPallasOptions,
    PallasBlockSizes,
    PallasOptions,
    XlaBlockSizes,
    token_logps,
    token_logps_from_hidden,
)
from tests.helpers import as64, rel_err

IMPLS = ("reference", "xla", "pallas-tpu", "pallas-gpu")
HEAD_IMPLS = ("reference", "xla", "pallas")


def _logits_args(impl):
    """``(impl, options)``: small blocks, so the sweeps and kernels take several steps."""
    if impl == "xla":
        return "xla", XlaBlockSizes(chunk_tokens=4, block_vocab=128)
    if impl == "pallas-tpu":
        return "pallas", PallasOptions(kernel="tpu", blocks=PallasBlockSizes(block_rows=16,
                                                                             block_vocab=128))
    if impl == "pallas-gpu":
        return "pallas", PallasOptions(kernel="gpu", blocks=PallasBlockSizes(block_vocab=128))
    return impl, None


def _head_args(impl):
    if impl == "xla":
        return "xla", LmHeadBlockSizes(chunk_tokens=8)
    if impl == "pallas":
        return "pallas", LmHeadPallasOptions(blocks=LmHeadPallasBlockSizes(
            block_rows=16, block_vocab=128))
    return impl, None


def oracle(z, ids, tau):
    """float64 NumPy: ``(log_softmax(z / tau)[ids], entropy)``."""
    s = np.asarray(jnp.asarray(z, jnp.float32), np.float64) / tau
    s = s - s.max(-1, keepdims=True)
    logsm = s - np.log(np.exp(s).sum(-1, keepdims=True))
    ids = np.clip(np.asarray(ids), 0, z.shape[-1] - 1)
    p = np.exp(logsm)
    return (np.take_along_axis(logsm, ids[..., None], -1)[..., 0],
            -np.where(p > 0, p * logsm, 0.0).sum(-1))


def _inputs(seed, b, t, v, dtype, scale=3.0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    z = (scale * jax.random.normal(k1, (b, t, v))).astype(dtype)
    ids = jax.random.randint(k2, (b, t), -2, v + 2)  # some out of range: clamped
    return z, ids


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_reference_equals_the_float64_oracle(dtype, tau):
    z, ids = _inputs(0, 3, 5, 300, dtype)
    logp, ent = token_logps(z, ids, temperature=tau, impl="reference", return_entropy=True)
    want_logp, want_ent = oracle(z, ids, tau)
    assert logp.dtype == ent.dtype == jnp.float32
    np.testing.assert_allclose(as64(logp), want_logp, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(as64(ent), want_ent, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype, tau", [(jnp.float32, 0.7), (jnp.bfloat16, 1.0)],
                         ids=["f32-t0.7", "bf16-t1"])
def test_every_impl_equals_the_reference_with_its_gradient(impl, dtype, tau):
    """Values, and the gradient of a random combination of log-probs and entropies."""
    name, options = _logits_args(impl)
    z, ids = _inputs(1, 2, 9, 333, dtype)  # V not a multiple of any block
    ct = jax.random.normal(jax.random.key(2), (2, 2, 9))

    def f(impl, options):
        def scalar(z):
            logp, ent = token_logps(z, ids, temperature=tau, impl=impl, options=options,
                                    return_entropy=True)
            return jnp.sum(ct[0] * logp + ct[1] * ent), (logp, ent)
        return jax.value_and_grad(scalar, has_aux=True)(z)

    (_, (logp, ent)), dz = f(name, options)
    (_, (logp_r, ent_r)), dz_r = f("reference", None)
    np.testing.assert_allclose(as64(logp), as64(logp_r), atol=2e-5)
    np.testing.assert_allclose(as64(ent), as64(ent_r), atol=2e-5)
    assert dz.dtype == z.dtype
    assert rel_err(dz, dz_r) <= (2e-5 if dtype == jnp.float32 else 1e-2)
    alone = token_logps(z, ids, temperature=tau, impl=name, options=options)
    np.testing.assert_allclose(as64(alone), as64(logp), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", HEAD_IMPLS)
@pytest.mark.parametrize("layout, bias, dtypes", [
    ("hv", False, (jnp.float32, jnp.float32, None)),
    ("vh", True, (jnp.bfloat16, jnp.bfloat16, jnp.float32)),
    ("vh", False, (jnp.bfloat16, jnp.float32, jnp.bfloat16)),
], ids=["hv-f32", "vh-bias-bf16-f32head", "vh-mixed-bf16logits"])
def test_from_hidden_equals_the_logits_it_would_form(impl, layout, bias, dtypes):
    h_dtype, w_dtype, logits_dtype = dtypes
    b, t, hdim, v = 2, 11, 24, 300
    k = jax.random.split(jax.random.key(3), 5)
    h = jax.random.normal(k[0], (b, t, hdim)).astype(h_dtype)
    w = (0.4 * jax.random.normal(k[1], (hdim, v) if layout == "hv" else (v, hdim))
         ).astype(w_dtype)
    bb = 0.1 * jax.random.normal(k[2], (v,)) if bias else None
    ids = jax.random.randint(k[3], (b, t), 0, v)
    ct = jax.random.normal(k[4], (2, b, t))
    name, options = _head_args(impl)

    def f(impl, options):
        def scalar(h, w, bb):
            logp, ent = token_logps_from_hidden(
                h, w, ids, lm_head_layout=layout, bias=bb, temperature=0.8,
                logits_dtype=logits_dtype, impl=impl, options=options, return_entropy=True)
            return jnp.sum(ct[0] * logp + ct[1] * ent), (logp, ent)
        return jax.value_and_grad(scalar, argnums=(0, 1, 2) if bias else (0, 1),
                                  has_aux=True)(h, w, bb)

    (_, (logp, ent)), grads = f(name, options)
    (_, (logp_r, ent_r)), grads_r = f("reference", None)
    np.testing.assert_allclose(as64(logp), as64(logp_r), atol=1e-4)
    np.testing.assert_allclose(as64(ent), as64(ent_r), atol=1e-4)
    bf16 = jnp.bfloat16 in (h_dtype, w_dtype, logits_dtype)
    for g, g_r, x in zip(grads, grads_r, (h, w, bb)):
        assert g.dtype == x.dtype and rel_err(g, g_r) <= (2e-2 if bf16 else 2e-5)
    # the same numbers as the logits-level op on the logits the head forms
    from grpo_kernels.ops.lm_head_loss.head import head_logits
    z = head_logits(h, w, layout, bb, logits_dtype or jnp.result_type(h_dtype, w_dtype))
    np.testing.assert_allclose(as64(token_logps(z, ids, temperature=0.8, impl="reference")),
                               as64(logp_r), atol=1e-6)


@pytest.mark.default_emitters
def test_no_logits_sized_temporaries():
    """Compile-only: xla's log-probs from logits hold no float32 copy of them, and from
    hidden states nothing of size [B, T, V] at all."""
    b, t, v, hdim = 8, 2048, 8192, 64
    z = jax.ShapeDtypeStruct((b, t, v), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((b, t), jnp.int32)
    f32_logits = 4 * b * t * v
    temp = jax.jit(lambda z, ids: token_logps(z, ids, impl="xla")).lower(z, ids).compile()
    assert temp.memory_analysis().temp_size_in_bytes < 0.25 * f32_logits
    h = jax.ShapeDtypeStruct((b, t, hdim), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((hdim, v), jnp.bfloat16)
    fused = jax.jit(lambda h, w, ids: token_logps_from_hidden(h, w, ids, impl="xla")).lower(
        h, w, ids).compile()
    assert fused.memory_analysis().temp_size_in_bytes < 0.2 * (2 * b * t * v)  # bf16 [B, T, V]


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=0.0), "temperature must be a finite number > 0, got 0.0"),
    (dict(temperature=-1), "temperature must be a finite number > 0, got -1"),
    (dict(temperature=float("nan")), "temperature must be a finite number > 0"),
    (dict(temperature=float("inf")), "temperature must be a finite number > 0"),
    (dict(temperature=True), "temperature must be a finite number > 0, got True"),
    (dict(ids=jnp.zeros((2, 4), jnp.int32)), "ids must have shape [B, T] = (2, 3)"),
    (dict(ids=jnp.zeros((2, 3), jnp.float32)), "ids must be an integer dtype"),
    (dict(logits=jnp.zeros((2, 3), jnp.float32)), "logits must have rank 3"),
    (dict(logits=jnp.zeros((2, 3, 5), jnp.int32)), "logits must be a floating dtype"),
    (dict(impl="triton"), "impl must be one of"),
    (dict(impl="xla", options=PallasOptions()), "options must be XlaBlockSizes"),
])
def test_bad_arguments_name_the_argument(kwargs, message):
    args = dict(logits=jax.random.normal(jax.random.key(0), (2, 3, 5)),
                ids=jnp.zeros((2, 3), jnp.int32))
    args.update(kwargs)
    with pytest.raises(ValueError, match=None) as e:
        token_logps(args.pop("logits"), args.pop("ids"), **args)
    assert message in str(e.value)


@pytest.mark.parametrize("kwargs, message", [
    (dict(lm_head=jnp.zeros((7, 5))), "lm_head with lm_head_layout='hv' must have shape"),
    (dict(lm_head_layout="nv"), "lm_head_layout must be one of"),
    (dict(bias=jnp.zeros((4,))), "bias must have shape [V] = (5,)"),
    (dict(temperature=0), "temperature must be a finite number > 0, got 0"),
    (dict(ids=jnp.zeros((3, 2), jnp.int32)), "ids must have shape [B, T] = (2, 3)"),
    (dict(logits_dtype=jnp.int8), "logits_dtype must be None, bfloat16"),
    (dict(impl="pallas", options=LmHeadBlockSizes()), "options must be LmHeadBlockSizes"),
])
def test_bad_head_arguments_name_the_argument(kwargs, message):
    args = dict(hidden=jnp.ones((2, 3, 4)), lm_head=jnp.ones((4, 5)),
                ids=jnp.zeros((2, 3), jnp.int32))
    args.update(kwargs)
    with pytest.raises(ValueError) as e:
        token_logps_from_hidden(args.pop("hidden"), args.pop("lm_head"), args.pop("ids"),
                                **args)
    assert message in str(e.value)


def test_check_ids_names_the_first_bad_id():
    z = jnp.zeros((1, 3, 5))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 5\).*ids\[0, 2\] = 7"):
        token_logps(z, jnp.array([[0, 4, 7]]), check_ids=True)
    with pytest.raises(ValueError, match=r"ids\[0, 0\] = -1"):
        token_logps_from_hidden(jnp.ones((1, 3, 2)), jnp.ones((2, 5)), jnp.array([[-1, 0, 0]]),
                                check_ids=True)
