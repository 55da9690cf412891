"""Our tunix losses and log-prob pass on a mesh of 8 simulated devices, inside tunix's own jitted
steps: the model partitioned by tunix's sharding rules (its activation constraints applied as on
an accelerator), the mesh entered as tunix's RLCluster enters it. Equal to tunix's own on one
device; our shard_map ops hold less per device than tunix's loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

pytest.importorskip("tunix", reason="google-tunix is not installed (make test installs it)")

from flax import nnx  # noqa: E402
from tunix.rl import algo_core, common  # noqa: E402
from tunix.rl.grpo.grpo_learner import GRPOConfig  # noqa: E402

from grpo_kernels.integrations import tunix as ours  # noqa: E402
from grpo_kernels.integrations.tunix.models import Head  # noqa: E402
from grpo_kernels.sharding import ShardingSpec  # noqa: E402
from tests.integrations.tunix_models import (  # noqa: E402
    EOS, PAD, max_rel_err, tiny_model, train_example)

VOCAB = 256  # divisible by the tp axis
# The vocabulary over tp (a tied head), and a mesh without one (tp = 1: the batch alone is
# split; an untied head). Both heads have H split over fsdp, as tunix places them.
MESHES = {"fsdp4xtp2": ((4, 2), True), "fsdp8xtp1": ((8, 1), False)}
TOL = 1e-5


@pytest.fixture
def tunix_sharding(monkeypatch):
    """tunix's models constrain their activations only off CPU (their ``shard`` returns ``x`` on
    CPU): here they constrain them as on an accelerator. tunix's code mixes bool and int32
    arrays, so JAX's standard promotion rules apply (as in tests/integrations/conftest.py)."""
    from jax.interpreters import pxla
    from tunix.models.qwen3 import model as qwen3

    saved = (jax.config.jax_numpy_dtype_promotion, jax.config.jax_numpy_rank_promotion)
    jax.config.update("jax_numpy_dtype_promotion", "standard")
    jax.config.update("jax_numpy_rank_promotion", "allow")

    def shard(x, s):
        mesh = pxla.thread_resources.env.physical_mesh
        return x if mesh.empty else jax.lax.with_sharding_constraint(
            x, NamedSharding(mesh, P(*s)))
    monkeypatch.setattr(qwen3, "shard", shard)
    yield
    jax.config.update("jax_numpy_dtype_promotion", saved[0])
    jax.config.update("jax_numpy_rank_promotion", saved[1])


def _partitioned(model, mesh):
    """``(graphdef, state)`` with the state placed by the model's own partition specs, as
    tunix's RLCluster places it."""
    graphdef, state = nnx.split(model)
    specs = nnx.get_partition_spec(state)
    return graphdef, jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s if s is not None else P())),
        state, specs)


def _algo():
    cfg = GRPOConfig(loss_agg_mode="sequence-mean-token-mean", kl_loss_mode="low_var_kl",
                     loss_algo="grpo", beta=0.04, epsilon=0.2, num_generations=2)
    cfg.temperature = 0.7
    return cfg


def _step(loss_fn, graphdef, state, example, algo, mesh=None):
    """tunix's trainer step: jit(value_and_grad) of the policy loss w.r.t. the parameters,
    under the mesh as RLCluster enters it."""
    def f(params, rest, ex):
        model = nnx.merge(graphdef, params, rest)
        out = loss_fn(model, ex, algo, PAD, EOS)
        return ours.differentiated(out), out

    params = nnx.state(nnx.merge(graphdef, state), nnx.Param)
    rest = nnx.state(nnx.merge(graphdef, state), nnx.Not(nnx.Param))
    step = jax.jit(jax.value_and_grad(f, has_aux=True))
    if mesh is None:
        return step(params, rest, example), None
    with mesh:  # one compile: the program whose plan is read is the one that ran
        compiled = step.lower(params, rest, example).compile()
        out = compiled(params, rest, example)
    return out, compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.default_emitters
def test_losses_and_log_probs_on_tunix_mesh_equal_one_device(mesh_name, tunix_sharding):
    shape, tied = MESHES[mesh_name]
    mesh = jax.make_mesh(shape, ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
    model = tiny_model("qwen3", seed=11, tied=tied, vocab=VOCAB)
    example = train_example(model, seed=12, batch=8, sampler=False, vocab=VOCAB)
    algo = _algo()
    graphdef, state = nnx.split(model)
    want, _ = _step(algo_core.grpo_loss_fn, graphdef, state, example, algo)
    g, placed = _partitioned(model, mesh)
    head = _head(tied)
    with mesh:
        where = ours.placement(nnx.merge(g, placed), 8, VOCAB, head)
    tp = shape[1]
    assert where is not None and where[1] == ShardingSpec(("fsdp",), "tp" if tp > 1 else None,
                                                          ("fsdp",))
    temps = {}
    for name, fn in (("grpo", algo_core.grpo_loss_fn), ("grpo_kernels", ours.logits_policy_loss),
                     ("grpo_kernels_fused", ours.fused_policy_loss)):
        ((loss, out), grads), temps[name] = _step(fn, g, placed, example, algo, mesh)
        np.testing.assert_allclose(float(loss), float(want[0][0]), rtol=TOL, atol=1e-7)
        aux, want_aux = (_aux(o) for o in (out, want[0][1]))
        for key in ("kl", "pg_clipfrac"):
            np.testing.assert_allclose(_value(aux[key]), _value(want_aux[key]), rtol=TOL,
                                       atol=1e-7, err_msg=key)
        assert max_rel_err(grads, want[1]) <= TOL, name
    # the fused loss through our shard_map plans less per device than tunix's own loss
    assert temps["grpo_kernels_fused"] < temps["grpo"], temps
    # the patched log-prob pass, jitted by tunix's rules, on the mesh
    want_logps = common.compute_per_token_logps(graphdef, state, example.prompt_ids,
                                                example.completion_ids, PAD, EOS)
    fn = ours.log_probs_function("xla")
    with mesh:
        got = fn(g, placed, example.prompt_ids, example.completion_ids, PAD, EOS)
    assert fn.calls == {"ours": 1, "tunix": 0}
    np.testing.assert_allclose(np.asarray(got), np.asarray(want_logps), rtol=TOL, atol=1e-6)
    if tp > 1:
        _check_truncation_on_mesh(model, g, placed, example, algo, mesh)


def _check_truncation_on_mesh(model, g, placed, example, algo, mesh):
    """A sampler's truncation on a mesh whose tp axis splits the vocabulary: placement keeps
    rows whole (no vocab axis, the head gathered whole) and the fused loss and the log-prob
    pass equal ours on one device, truncated."""
    algo.top_k, algo.top_p = 20, 0.9
    head = _head(tied=True)
    with mesh:
        where = ours.placement(nnx.merge(g, placed), 8, VOCAB, head, whole_rows=True)
    assert where[1] == ShardingSpec(("fsdp",), None, ())
    graphdef, state = nnx.split(model)
    (want, want_grads), _ = _step(ours.fused_policy_loss, graphdef, state, example, algo)
    (got, grads), _ = _step(ours.fused_policy_loss, g, placed, example, algo, mesh)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=TOL, atol=1e-7)
    assert max_rel_err(grads, want_grads) <= TOL
    assert _value(_aux(got[1])["grpo_kernels/outside_truncation"]) == _value(
        _aux(want[1])["grpo_kernels/outside_truncation"])
    fn = ours.log_probs_function("xla", truncation=ours.sampler_truncation(algo))
    want_logps = fn(graphdef, state, example.prompt_ids, example.completion_ids, PAD, EOS)
    with mesh:
        got_logps = fn(g, placed, example.prompt_ids, example.completion_ids, PAD, EOS)
    assert fn.calls == {"ours": 2, "tunix": 0}
    np.testing.assert_allclose(np.asarray(got_logps), np.asarray(want_logps), rtol=TOL,
                               atol=1e-6)


def _aux(out):
    """A policy loss's aux dict: 0.1.7's, or the head's ``LossOutput.aux_metrics``."""
    return out[1] if isinstance(out, tuple) else out.aux_metrics


def _value(x):
    """An aux entry's value: a scalar, or a ``WeightedMetric`` divided."""
    return float(x.compute() if hasattr(x, "compute") else x)


def _head(tied: bool, hidden: int = 32) -> Head:
    """A head as :func:`placement` reads it (its layout and shape)."""
    shape, layout = ((VOCAB, hidden), "vh") if tied else ((hidden, VOCAB), "hv")
    return Head(jnp.zeros(shape), layout, jnp.dtype(jnp.float32), None)


def test_placement_leaves_out_what_does_not_divide(tunix_sharding):
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
    model = tiny_model("qwen3", seed=13, vocab=VOCAB)
    assert ours.placement(model, 8, VOCAB) is None  # no mesh in context
    with mesh:
        assert ours.placement(model, 8, 257)[1] == ShardingSpec(("fsdp",), None)
        assert ours.placement(model, 6, VOCAB)[1] == ShardingSpec((), "tp")
        assert ours.placement(model, 6, 257) is None
        # H split over fsdp where tunix splits it and it divides; not where the batch is not
        assert ours.placement(model, 8, VOCAB, _head(False))[1].head_axes == ("fsdp",)
        assert ours.placement(model, 8, VOCAB, _head(True, 30))[1].head_axes == ()
        assert ours.placement(model, 6, VOCAB, _head(True))[1].head_axes == ()
