"""Meshes as users make them: ``jax.make_mesh`` (Explicit axes by default) and Auto meshes, with
inputs in whatever layout a model hands them. Every sharded entry equals one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_kernels import GRPOLossConfig, grpo_loss, grpo_loss_from_hidden
from grpo_kernels.compat import explicit_axes
from grpo_kernels.ops.lm_head_loss.inputs import random_head_inputs
from grpo_kernels.ops.logits_loss.inputs import random_inputs
from grpo_kernels.sharding import ShardingSpec, sharded_grpo_loss, sharded_grpo_loss_from_hidden
from tests.helpers import rel_err

SPEC = ShardingSpec(batch_axes=("dp",), vocab_axis="tp")
CONFIG = GRPOLossConfig(beta=0.04, temperature=0.7, max_completion_length=8)
KINDS = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}
# Each implementation meets each kind of mesh and each input layout once.
CASES = [("explicit", "xla", "batch"), ("explicit", "reference", "op"),
         ("auto", "reference", "batch"), ("auto", "xla", "op")]


def _mesh(kind):
    return jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(KINDS[kind],) * 2)


def _place(mesh, x, layout):
    """``x`` split over the batch only (as a model hands it: ``P("dp")``), in the op's own
    layout, or left where it is (``None``)."""
    if layout is None or x is None:
        return x
    return jax.device_put(x, NamedSharding(mesh, layout))


def _close(got, want, grad_tol=2e-5):
    (loss, metrics), grads = got
    (loss_r, metrics_r), grads_r = want
    assert np.isfinite(float(loss))
    np.testing.assert_allclose(float(loss), float(loss_r), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(np.asarray(metrics["logp"]), np.asarray(metrics_r["logp"]),
                               atol=2e-5)
    for g, g_r in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_r), strict=True):
        assert g.shape == g_r.shape and rel_err(g, g_r) <= grad_tol


def test_make_mesh_is_explicit_and_auto_is_not():
    assert explicit_axes(jax.make_mesh((2, 4), ("dp", "tp")))
    assert not explicit_axes(_mesh("auto"))


@pytest.mark.parametrize("kind, impl, layout", CASES)
def test_logits_loss_on_made_meshes(kind, impl, layout):
    mesh = _mesh(kind)
    inp = random_inputs(3, 4, 8, 64, jnp.float32, CONFIG)
    want = jax.value_and_grad(lambda z: grpo_loss(
        z, inp.ids, inp.mask, inp.advantages, config=CONFIG, impl="reference", **inp.kwargs()),
        has_aux=True)(inp.logits)
    z_layout = P("dp") if layout == "batch" else P("dp", None, "tp")
    rows = P("dp") if layout == "batch" else None  # the op's [B, T] layout is P("dp") too
    kw = {k: _place(mesh, v, rows) for k, v in inp.kwargs().items()}

    def loss(z, ids, mask, adv, kw):
        return sharded_grpo_loss(z, ids, mask, adv, mesh=mesh, sharding=SPEC, config=CONFIG,
                                 impl=impl, **kw)

    args = (_place(mesh, inp.logits, z_layout), _place(mesh, inp.ids, rows),
            _place(mesh, inp.mask, rows), _place(mesh, inp.advantages, rows))
    got = jax.jit(jax.value_and_grad(loss, has_aux=True))(*args, kw)
    _close(got, want)


@pytest.mark.parametrize("kind, impl, layout", CASES)
def test_hidden_loss_on_made_meshes(kind, impl, layout):
    """The xla head runs sequence-parallel here (T = 8 divides tp = 4): its hidden states'
    layout ``P("dp", "tp")`` is not the batch-only one a model gives."""
    mesh = _mesh(kind)
    inp = random_head_inputs(5, 4, 8, 16, 64, jnp.float32, CONFIG, layout="vh")

    def one(h, w):
        return grpo_loss_from_hidden(h, w, inp.ids, inp.mask, inp.advantages, config=CONFIG,
                                     impl="reference", lm_head_layout="vh",
                                     old_logps=inp.old_logps, ref_logps=inp.ref_logps)

    want = jax.value_and_grad(one, argnums=(0, 1), has_aux=True)(inp.hidden, inp.lm_head)
    h_layout, w_layout = ((P("dp"), P()) if layout == "batch"
                          else ((P("dp", "tp") if impl == "xla" else P("dp")), P("tp")))

    def loss(h, w, ids, mask, adv, old, ref):
        return sharded_grpo_loss_from_hidden(h, w, ids, mask, adv, mesh=mesh, sharding=SPEC,
                                             config=CONFIG, impl=impl, lm_head_layout="vh",
                                             old_logps=old, ref_logps=ref)

    rows = P("dp")
    args = (_place(mesh, inp.hidden, h_layout), _place(mesh, inp.lm_head, w_layout),
            *(_place(mesh, x, rows) for x in (inp.ids, inp.mask, inp.advantages,
                                              inp.old_logps, inp.ref_logps)))
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(*args)
    _close(got, want)
    # eagerly too: shard_map outside jit on an Explicit mesh
    eager = sharded_grpo_loss_from_hidden(*args[:2], *args[2:5], mesh=mesh, sharding=SPEC,
                                          config=CONFIG, impl=impl, lm_head_layout="vh",
                                          old_logps=args[5], ref_logps=args[6])
    np.testing.assert_allclose(float(eager[0]), float(want[0][0]), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("kind, head_layout", [("explicit", None), ("auto", "op")])
def test_fsdp_head_on_made_meshes(kind, head_layout):
    """``head_axes``: the head's H split over the batch axis (FSDP weights). On an Explicit
    mesh a head placed anywhere else is moved to ``P("tp", "dp")`` first; on an Auto mesh,
    placed there already, it is taken as it is. The gradient comes back in that layout."""
    mesh = _mesh(kind)
    spec = ShardingSpec(batch_axes=("dp",), vocab_axis="tp", head_axes=("dp",))
    inp = random_head_inputs(7, 4, 8, 16, 64, jnp.float32, CONFIG, layout="vh")

    def one(h, w):
        return grpo_loss_from_hidden(h, w, inp.ids, inp.mask, inp.advantages, config=CONFIG,
                                     impl="reference", lm_head_layout="vh",
                                     old_logps=inp.old_logps, ref_logps=inp.ref_logps)

    def loss(h, w):
        return sharded_grpo_loss_from_hidden(h, w, inp.ids, inp.mask, inp.advantages,
                                             mesh=mesh, sharding=spec, config=CONFIG,
                                             impl="xla", lm_head_layout="vh",
                                             old_logps=inp.old_logps, ref_logps=inp.ref_logps)

    want = jax.value_and_grad(one, argnums=(0, 1), has_aux=True)(inp.hidden, inp.lm_head)
    w = _place(mesh, inp.lm_head, P("tp", "dp") if head_layout == "op" else None)
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        _place(mesh, inp.hidden, P("dp")), w)
    _close(got, want)
    assert got[1][1].sharding.spec == P("tp", "dp")
