"""The sharded log-prob ops equal the one-device ops (values and gradients), on every mesh of the
loss tests, with ``[B, T]``-sized collectives only."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from grpo_kernels import (
    LmHeadPallasBlockSizes,
    LmHeadPallasOptions,
    PallasBlockSizes,
    PallasOptions,
    token_logps,
    token_logps_from_hidden,
)
from grpo_kernels.sharding import (
    ShardingSpec,
    sharded_token_logps,
    sharded_token_logps_from_hidden,
)
from grpo_kernels.sharding.hlo import collectives
from tests.helpers import as64, rel_err
from tests.sharding.conftest import MESHES, make, mesh_id

B, T, V, H = 8, 6, 256, 32
# Each implementation meets two meshes; the four meshes meet reference, xla and pallas.
CASES = [(MESHES[0], "xla"), (MESHES[1], "pallas"), (MESHES[2], "reference"),
         (MESHES[3], "xla"), (MESHES[1], "xla"), (MESHES[2], "pallas")]


def _options(impl, head):
    if impl != "pallas":
        return None
    if head:
        return LmHeadPallasOptions(blocks=LmHeadPallasBlockSizes(block_rows=16, block_vocab=128))
    return PallasOptions(kernel="tpu", blocks=PallasBlockSizes(block_rows=16, block_vocab=128))


def _grads(f, *args):
    ct = jax.random.normal(jax.random.key(9), (2, B, T))

    def scalar(*a):
        logp, ent = f(*a)
        return jnp.sum(ct[0] * logp + ct[1] * ent), (logp, ent)
    return jax.jit(jax.value_and_grad(scalar, argnums=tuple(range(len(args))),
                                      has_aux=True))(*args)


def _same(got, want, tol=2e-5):
    (_, (logp, ent)), grads = got
    (_, (logp_r, ent_r)), grads_r = want
    np.testing.assert_allclose(as64(logp), as64(logp_r), atol=tol)
    np.testing.assert_allclose(as64(ent), as64(ent_r), atol=tol)
    for g, g_r in zip(grads, grads_r, strict=True):
        assert g.shape == g_r.shape and rel_err(g, g_r) <= tol


@pytest.mark.parametrize("m, impl", CASES, ids=[f"{mesh_id(m)}-{i}" for m, i in CASES])
def test_logits_logps_equal_one_device(m, impl):
    mesh, spec = make(m)
    k1, k2 = jax.random.split(jax.random.key(1))
    z = 3 * jax.random.normal(k1, (B, T, V))
    ids = jax.random.randint(k2, (B, T), 0, V)
    opts = _options(impl, head=False)
    got = _grads(lambda z: sharded_token_logps(z, ids, mesh=mesh, sharding=spec, impl=impl,
                                               options=opts, temperature=0.7,
                                               return_entropy=True), z)
    want = _grads(lambda z: token_logps(z, ids, impl="reference", temperature=0.7,
                                        return_entropy=True), z)
    _same(got, want)


@pytest.mark.parametrize("m, impl", CASES, ids=[f"{mesh_id(m)}-{i}" for m, i in CASES])
def test_hidden_logps_equal_one_device(m, impl):
    """The head's H split over the last batch axis (``head_axes``, FSDP weights as tunix places
    them): the xla head gathers it by vocabulary blocks; the others gather it whole first."""
    mesh, spec = make(m)
    spec = dataclasses.replace(spec, head_axes=spec.batch_axes[-1:])
    k = jax.random.split(jax.random.key(2), 4)
    h = jax.random.normal(k[0], (B, T, H))
    w = jax.device_put(0.5 * jax.random.normal(k[1], (V, H)),
                       jax.sharding.NamedSharding(mesh, spec.on(mesh).head("vh")))
    bias = 0.1 * jax.random.normal(k[2], (V,))
    ids = jax.random.randint(k[3], (B, T), 0, V)
    opts = _options(impl, head=True)
    kw = dict(lm_head_layout="vh", return_entropy=True, temperature=1.3)
    got = _grads(lambda h, w, b: sharded_token_logps_from_hidden(
        h, w, ids, mesh=mesh, sharding=spec, bias=b, impl=impl, options=opts, **kw), h, w, bias)
    want = _grads(lambda h, w, b: token_logps_from_hidden(h, w, ids, bias=b, impl="reference",
                                                          **kw), h, w, bias)
    _same(got, want)


@pytest.mark.default_emitters
def test_explicit_mesh_batch_split_inputs_and_collective_sizes():
    """On a jax.make_mesh mesh (Explicit axes), with hidden states split over the batch only
    and a head split over nothing: the same log-probs, and no collective larger than a chunk
    of hidden rows or the [B/b, T] statistics."""
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    spec = ShardingSpec(("dp",), "tp")
    k = jax.random.split(jax.random.key(3), 3)
    h = jax.device_put(jax.random.normal(k[0], (B, 8, H)),
                       jax.sharding.NamedSharding(mesh, jax.P("dp")))
    w = 0.5 * jax.random.normal(k[1], (H, V))
    ids = jax.random.randint(k[2], (B, 8), 0, V)
    f = jax.jit(lambda h, w: sharded_token_logps_from_hidden(h, w, ids, mesh=mesh,
                                                             sharding=spec, impl="xla"))
    np.testing.assert_allclose(as64(f(h, w)), as64(token_logps_from_hidden(
        jnp.asarray(h), w, ids, impl="reference")), atol=2e-5)
    largest = max(c.elements for c in collectives(f.lower(h, w).compile().as_text()))
    assert largest < V * 8  # nothing of [T, V]; chunks of hidden rows and [B/b, T] vectors


def test_soft_capped_losses_and_log_probs_on_a_mesh():
    """logit_softcap through the sharded ops (xla and the Pallas kernels; the reference's
    statistics on capped logits) equals one device: both log-prob ops and both losses."""
    from grpo_kernels import GRPOLossConfig, grpo_loss, grpo_loss_from_hidden
    from grpo_kernels.sharding import sharded_grpo_loss, sharded_grpo_loss_from_hidden

    mesh, spec = make(MESHES[1])
    k = jax.random.split(jax.random.key(4), 4)
    h = jax.random.normal(k[0], (B, T, H))
    w = 0.5 * jax.random.normal(k[1], (H, V))
    ids = jax.random.randint(k[2], (B, T), 0, V)
    z = 3 * jax.random.normal(k[3], (B, T, V))
    for impl in ("reference", "xla", "pallas"):
        got = _grads(lambda z: sharded_token_logps(z, ids, mesh=mesh, sharding=spec, impl=impl,
                                                   options=_options(impl, head=False),
                                                   logit_softcap=2.5, return_entropy=True), z)
        want = _grads(lambda z: token_logps(z, ids, impl="reference", logit_softcap=2.5,
                                            return_entropy=True), z)
        _same(got, want)
        got = _grads(lambda h, w: sharded_token_logps_from_hidden(
            h, w, ids, mesh=mesh, sharding=spec, impl=impl, options=_options(impl, head=True),
            logit_softcap=2.5, return_entropy=True), h, w)
        want = _grads(lambda h, w: token_logps_from_hidden(
            h, w, ids, impl="reference", logit_softcap=2.5, return_entropy=True), h, w)
        _same(got, want)
    cfg = GRPOLossConfig(beta=0.0)
    mask, adv = jnp.ones((B, T)), jax.random.normal(k[0], (B,))
    one = jax.grad(lambda z: grpo_loss(z, ids, mask, adv, config=cfg, impl="reference",
                                       logit_softcap=2.5)[0])(z)
    sharded = jax.jit(jax.grad(lambda z: sharded_grpo_loss(
        z, ids, mask, adv, mesh=mesh, sharding=spec, config=cfg, impl="xla",
        logit_softcap=2.5)[0]))(z)
    assert rel_err(sharded, one) <= 2e-5
    one = jax.grad(lambda h: grpo_loss_from_hidden(h, w, ids, mask, adv, config=cfg,
                                                   impl="reference", logit_softcap=2.5)[0])(h)
    sharded = jax.jit(jax.grad(lambda h: sharded_grpo_loss_from_hidden(
        h, w, ids, mask, adv, mesh=mesh, sharding=spec, config=cfg, impl="xla",
        logit_softcap=2.5)[0]))(h)
    assert rel_err(sharded, one) <= 2e-5


def test_truncation_where_each_device_holds_whole_rows():
    """A sampler's truncation on meshes that keep vocabulary rows whole (no vocab axis: the
    batch over dp and fsdp with tp replicating; a tp axis of size 1): both log-prob ops and
    the fused loss equal the one-device reference's truncated values, gradients and
    ``outside`` counts (ids half the rows' best, half random: both sides of the floor), the
    Pallas kernels' among them. A mesh that splits the rows and an FSDP-gathered xla head
    refuse."""
    from grpo_kernels import GRPOLossConfig, grpo_loss_from_hidden
    from grpo_kernels.sharding import sharded_grpo_loss_from_hidden

    k = jax.random.split(jax.random.key(5), 5)
    h = jax.random.normal(k[0], (B, T, H))
    w = 0.5 * jax.random.normal(k[1], (H, V))
    z = 3 * jax.random.normal(k[2], (B, T, V))
    best = jnp.argmax(z, axis=-1)
    ids = jnp.where(jax.random.bernoulli(k[3], 0.5, (B, T)), best,
                    jax.random.randint(k[4], (B, T), 0, V))
    runs = [(MESHES[3], ShardingSpec(("dp", "fsdp")), "xla", dict(top_k=20, top_p=0.9)),
            (MESHES[0], ShardingSpec(("dp",), "tp"), "pallas", dict(min_p=0.05, top_p=0.8)),
            (MESHES[3], ShardingSpec(("dp", "fsdp")), "reference", dict(top_k=5))]
    for m, spec, impl, trunc in runs:
        mesh = make(m)[0]
        kw = dict(return_entropy=True, temperature=0.7, **trunc)
        _same(_grads(lambda z: sharded_token_logps(z, ids, mesh=mesh, sharding=spec,
                                                   impl=impl, **kw), z),
              _grads(lambda z: token_logps(z, ids, impl="reference", **kw), z))
        if impl != "reference":
            _same(_grads(lambda h, w: sharded_token_logps_from_hidden(
                h, w, ids, mesh=mesh, sharding=spec, impl=impl, **kw), h, w),
                  _grads(lambda h, w: token_logps_from_hidden(h, w, ids, impl="reference",
                                                              **kw), h, w))
    outside = sharded_token_logps(z, ids, mesh=mesh, sharding=spec, return_outside=True,
                                  **trunc)[1]
    want = token_logps(z, ids, impl="reference", return_outside=True, **trunc)[1]
    assert 0 < int(want.sum()) < B * T and bool(jnp.all(outside == want))
    cfg = GRPOLossConfig(beta=0.04, top_k=20, top_p=0.9)
    mask, adv = jnp.ones((B, T)), jax.random.normal(k[0], (B,))
    mesh, spec = make(MESHES[3])[0], ShardingSpec(("dp", "fsdp"))

    def loss(fn, **kw):
        return jax.jit(jax.value_and_grad(lambda h, w: fn(
            h, w, ids, mask, adv, config=cfg, impl="xla", ref_logps=-jnp.ones((B, T)),
            **kw), argnums=(0, 1), has_aux=True))(h, w)
    (got, got_m), got_g = loss(sharded_grpo_loss_from_hidden, mesh=mesh, sharding=spec)
    (want, want_m), want_g = loss(grpo_loss_from_hidden)
    np.testing.assert_allclose(float(got), float(want), rtol=2e-5)
    assert float(got_m["outside_truncation"]) == float(want_m["outside_truncation"]) > 0
    for g, g_r in zip(got_g, want_g, strict=True):
        assert rel_err(g, g_r) <= 2e-5
    for spec, impl, match in ((ShardingSpec(("dp",), "tp"), "xla", "splits V over 'tp'"),
                              (ShardingSpec(("dp", "fsdp"), head_axes=("fsdp",)), "xla",
                               "head_axes")):
        with pytest.raises(ValueError, match=match):
            sharded_token_logps_from_hidden(h, w, ids, mesh=mesh, sharding=spec, impl=impl,
                                            top_k=20)
