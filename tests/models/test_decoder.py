"""decoder.linear: the float32-accumulating projection and its hand-written gradient; the
loaders' empty decoder and its check that every weight was set."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_kernels.models.config import ModelConfig
from grpo_kernels.models.decoder import check_loaded, empty_decoder, linear
from tests.helpers import rel_err


def _inputs(seed, x_dtype, w_dtype):
    kx, kw, kg = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(kx, (3, 5, 24), jnp.float32).astype(x_dtype)
    w = (jax.random.normal(kw, (24, 40), jnp.float32) * 0.2).astype(w_dtype)
    g = jax.random.normal(kg, (3, 5, 40), jnp.float32)
    return x, w, g


def _vjp(fn, x, w, g):
    out, pull = jax.vjp(fn, x, w)
    return (out, *pull(g.astype(out.dtype)))


@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16], ids=["w_f32", "w_bf16"])
def test_f32_matches_autodiff_of_matmul(w_dtype):
    x, w, g = _inputs(0, jnp.float32, w_dtype)
    got = jax.jit(lambda x, w, g: _vjp(lambda a, b: linear(a, b, jnp.float32), x, w, g))(x, w, g)
    want = _vjp(lambda a, b: jnp.matmul(a, b.astype(jnp.float32), precision="highest"), x, w, g)
    for name, a, b in zip(("out", "dx", "dw"), got, want, strict=True):
        assert a.dtype == b.dtype, name
        assert a.shape == b.shape, name
        assert rel_err(a, b) <= 1e-6, name


def test_bf16_compute_rounds_once_and_keeps_f32_weight_gradients():
    """bf16 compute on float32 weights: the output is the float32 product of the bf16 operands
    rounded once; dx is bf16; dw is float32 (not rounded to bf16), the product x^T g of the
    bf16 operands."""
    x, w, g = _inputs(1, jnp.bfloat16, jnp.float32)
    out, dx, dw = jax.jit(lambda x, w, g: _vjp(lambda a, b: linear(a, b, jnp.bfloat16),
                                               x, w, g))(x, w, g)
    xf = np.asarray(x, np.float64)
    wb = np.asarray(w.astype(jnp.bfloat16), np.float64)
    gb = np.asarray(g.astype(jnp.bfloat16), np.float64)
    assert out.dtype == jnp.bfloat16 and dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    exact = xf @ wb  # one rounding to bf16 is within 2^-9 of it, element by element
    np.testing.assert_allclose(np.asarray(out, np.float64), exact,
                               rtol=2 ** -8, atol=1e-5 * np.abs(exact).max())
    np.testing.assert_allclose(np.asarray(dx, np.float64), gb @ wb.T,
                               rtol=2 ** -8, atol=1e-5 * np.abs(gb @ wb.T).max())
    want_dw = xf.reshape(-1, 24).T @ gb.reshape(-1, 40)
    # float32 accumulation of exact bf16 products: far tighter than one bf16 rounding
    assert rel_err(dw, want_dw) <= 1e-6
    assert np.all(np.isfinite(np.asarray(dw)))


def test_a_weight_left_unset_by_a_loader_is_named():
    """empty_decoder allocates nothing; check_loaded names what a loader did not set."""
    from flax import nnx

    config = ModelConfig(family="qwen2", vocab_size=61, hidden_size=32, intermediate_size=48,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         tie_word_embeddings=False)
    model = empty_decoder(config)
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert params and all(isinstance(p, jax.ShapeDtypeStruct) for p in params)
    rng = np.random.default_rng(0)
    for _, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param) and param is not model.lm_head:
            param.set_value(jnp.asarray(rng.normal(size=param.shape), param.dtype))
    with pytest.raises(ValueError, match=r"ckpt: no value loaded for 1 weight\(s\): .*lm_head"):
        check_loaded(model, "ckpt")
    model.lm_head.set_value(jnp.asarray(rng.normal(size=model.lm_head.shape), jnp.float32))
    assert check_loaded(model, "ckpt") is model
    ids = jnp.asarray(rng.integers(0, 61, (2, 5)), jnp.int32)
    assert np.isfinite(np.asarray(model(ids))).all()
