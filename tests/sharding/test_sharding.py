"""Sharded losses equal the one-device reference on 8 simulated devices (see conftest.py)."""

import dataclasses
import functools
import itertools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_kernels import (
    GRPOLossConfig,
    LmHeadBlockSizes,
    LmHeadPallasOptions,
    PallasBlockSizes,
    PallasOptions,
    grpo_loss,
    grpo_loss_from_hidden,
)
from grpo_kernels.config import CLASSIC_LOSS_TYPES
from grpo_kernels.ops.lm_head_loss.inputs import random_head_inputs
from grpo_kernels.objective import RowGrad, token_separable
from grpo_kernels.ops.logits_loss import pallas_tpu
from grpo_kernels.ops.logits_loss import xla as logits_xla
from grpo_kernels.ops.logits_loss.inputs import random_inputs
from grpo_kernels.sharding import (
    ShardingSpec,
    mesh_from_shape,
    sharded_grpo_loss,
    sharded_grpo_loss_from_hidden,
    sharded_token_logps_from_hidden,
)
from grpo_kernels.sharding.hlo import collectives
from tests.helpers import (as64, every_platform, family_grid, family_id, option_grid, option_id,
                           pairwise, rel_err)
from tests.sharding.conftest import MESHES, make, mesh_id

B, T, V = 8, 6, 64          # logits op: V/8 = 8 columns per device at tp=8
HB, HT, HH, HV = 8, 5, 32, 256  # LM-head op

TOL = dict(loss=2e-6, grad=2e-5, metric=2e-5)  # the core f32 tolerances (test_impls.py)


def _config(loss_type, level, beta, i):
    # Temperature and delta vary too, so every branch of the objective is reached.
    return GRPOLossConfig(loss_type=loss_type, importance_sampling_level=level, beta=beta,
                          temperature=(1.0, 0.7)[i % 2], delta=(None, 2.0)[(i // 2) % 2],
                          max_completion_length=T + 2)


CONFIGS = [_config(lt, lvl, beta, i) for i, (lt, lvl, beta) in enumerate(
    itertools.product(CLASSIC_LOSS_TYPES, ("token", "sequence"), (0.0, 0.04)))]
FEW = CONFIGS[::5]  # four configs spanning loss types and levels
# test_equals_one_device's factors: the mesh, the config's loss type, level, beta, temperature
# and delta, and the op with its implementation.
MESH_FACTORS = (range(len(MESHES)), CLASSIC_LOSS_TYPES, ("token", "sequence"), (0.0, 0.04),
                (1.0, 0.7), (None, 2.0),
                tuple(itertools.product(("logits", "lm_head"), ("xla", "pallas"))))


def pytest_generate_tests(metafunc):
    """test_equals_one_device's grid (``--mesh-grid``): by default every pair of levels of
    :data:`MESH_FACTORS` (each op and implementation meets every mesh and every level of each
    config field, and each field every mesh: the sharded body is one code path whatever the
    mesh, its collectives one per normaliser, and each implementation's whole grid on one
    device is in tests/ops); ``full`` every combination."""
    if "mesh_case" not in metafunc.fixturenames:
        return
    full = metafunc.config.getoption("--mesh-grid") == "full"
    cases = list(itertools.product(*MESH_FACTORS)) if full else pairwise(*MESH_FACTORS)
    metafunc.parametrize("mesh_case", cases, ids=[
        f"{mesh_id(MESHES[m])}-{lt}-{lvl}-b{beta}-t{tau}-d{delta}-{op}-{impl}"
        for m, lt, lvl, beta, tau, delta, (op, impl) in cases])


def cfg_id(c):
    return f"{c.loss_type}-{c.importance_sampling_level}-b{c.beta}"


def _check(got, want):
    (loss, metrics), grads = got
    (loss_r, metrics_r), grads_r = want
    assert np.isfinite(float(loss))
    np.testing.assert_allclose(float(loss), float(loss_r), rtol=TOL["loss"], atol=TOL["loss"])
    for g, g_r in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_r), strict=True):
        assert g.dtype == g_r.dtype and g.shape == g_r.shape
        assert rel_err(g, g_r) <= TOL["grad"]
    assert set(metrics) == set(metrics_r)
    per_token = {"logp", "token_entropy"}
    for key in per_token:
        np.testing.assert_allclose(as64(metrics[key]), as64(metrics_r[key]), atol=2e-5,
                                   err_msg=key)
    for key in set(metrics) - per_token:
        np.testing.assert_allclose(float(metrics[key]), float(metrics_r[key]),
                                   rtol=TOL["metric"], atol=TOL["metric"], err_msg=key)


# --- logits-level loss -----------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _logits_case(cfg):
    inp = random_inputs(7, B, T, V, jnp.float32, cfg)
    kw = dict(old_logps=inp.old_logps, ref_logps=inp.ref_logps)
    if cfg.loss_type == "dapo":
        kw["num_items_in_batch"] = float(jnp.sum(inp.mask)) + 3.0
    want = jax.value_and_grad(
        lambda z: grpo_loss(z, inp.ids, inp.mask, inp.advantages, config=cfg,
                            impl="reference", **kw), has_aux=True)(inp.logits)
    return inp, kw, want


def _sharded_logits(m, cfg, impl, **extra):
    inp, kw, want = _logits_case(cfg)
    mesh, spec = make(m)
    fn = jax.jit(jax.value_and_grad(
        lambda z: sharded_grpo_loss(z, inp.ids, inp.mask, inp.advantages, mesh=mesh,
                                    sharding=spec, config=cfg, impl=impl, **kw, **extra),
        has_aux=True))
    return fn(inp.logits), want


# Each of the four configs on two of the four meshes, each mesh with two configs: the
# reference's sharded body is one autodiff path whatever the pair.
MESH_PAIRS = [(MESHES[(i + j) % len(MESHES)], c) for i, c in enumerate(FEW) for j in (0, 1)]
PAIR_IDS = [f"{mesh_id(m)}-{cfg_id(c)}" for m, c in MESH_PAIRS]


@pytest.mark.parametrize("m,cfg", MESH_PAIRS, ids=PAIR_IDS)
def test_logits_sharded_reference_equals_one_device(m, cfg):
    """The autodiff path through pmax/psum, independent of the custom gradients."""
    _check(*_sharded_logits(m, cfg, "reference"))


def test_logits_pallas_gpu_kernel_sharded():
    """The Triton kernel's program (interpreted) under the vocab split: each shard's columns
    are one masked tile wider than the shard."""
    got = _sharded_logits(MESHES[1], FEW[1], "pallas",
                          options=PallasOptions(kernel="gpu",
                                                        blocks=PallasBlockSizes(block_vocab=128)))
    _check(*got)


def test_logits_bf16_matches_one_device_xla():
    cfg = GRPOLossConfig(beta=0.04)
    inp = random_inputs(3, B, T, V, jnp.bfloat16, cfg)
    mesh, spec = make(MESHES[3])

    def one(z):
        return grpo_loss(z, inp.ids, inp.mask, inp.advantages, config=cfg, impl="xla",
                         **inp.kwargs())

    def sharded(z):
        return sharded_grpo_loss(z, inp.ids, inp.mask, inp.advantages, mesh=mesh,
                                 sharding=spec, config=cfg, impl="xla", **inp.kwargs())

    (l1, _), g1 = jax.jit(jax.value_and_grad(one, has_aux=True))(inp.logits)
    (l8, _), g8 = jax.jit(jax.value_and_grad(sharded, has_aux=True))(inp.logits)
    assert g8.dtype == jnp.bfloat16
    np.testing.assert_allclose(float(l8), float(l1), rtol=1e-5)
    assert rel_err(g8, g1) <= 2 ** -7  # one bf16 rounding of dlogits apart at most


# --- fused LM-head loss ----------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _head_case(cfg, layout, bias):
    inp = random_head_inputs(11, HB, HT, HH, HV, jnp.float32, cfg, layout=layout)
    b = (jax.random.normal(jax.random.PRNGKey(5), (HV,)) * 0.5) if bias else None
    kw = dict(old_logps=inp.old_logps, ref_logps=inp.ref_logps, lm_head_layout=layout, bias=b)
    if cfg.loss_type == "dapo":
        kw["num_items_in_batch"] = float(jnp.sum(inp.mask)) + 3.0
    argnums = (0, 1, 2) if bias else (0, 1)

    def fn(h, w, bb):
        return grpo_loss_from_hidden(h, w, inp.ids, inp.mask, inp.advantages, config=cfg,
                                     impl="reference", **{**kw, "bias": bb})

    want = jax.value_and_grad(fn, argnums=argnums, has_aux=True)(inp.hidden, inp.lm_head, b)
    return inp, kw, argnums, want


def _sharded_head(m, cfg, impl, layout="hv", bias=False, fsdp=False, **extra):
    inp, kw, argnums, want = _head_case(cfg, layout, bias)
    mesh, spec = make(m)
    if fsdp:
        spec = dataclasses.replace(spec, head_axes=spec.batch_axes[-1:])

    def fn(h, w, bb):
        return sharded_grpo_loss_from_hidden(h, w, inp.ids, inp.mask, inp.advantages,
                                             mesh=mesh, sharding=spec, config=cfg, impl=impl,
                                             **{**kw, "bias": bb}, **extra)

    step = jax.jit(jax.value_and_grad(fn, argnums=argnums, has_aux=True))
    return step(inp.hidden, inp.lm_head, kw["bias"]), want


def test_equals_one_device(mesh_case):
    """Both ops, both fast implementations, the loss grid over the meshes."""
    m, loss_type, level, beta, tau, delta, (op, impl) = mesh_case
    cfg = GRPOLossConfig(loss_type=loss_type, importance_sampling_level=level, beta=beta,
                         temperature=tau, delta=delta, max_completion_length=T + 2)
    _check(*{"logits": _sharded_logits, "lm_head": _sharded_head}[op](MESHES[m], cfg, impl))


@pytest.mark.parametrize("m,cfg", MESH_PAIRS, ids=PAIR_IDS)
def test_lm_head_sharded_reference_equals_one_device(m, cfg):
    _check(*_sharded_head(m, cfg, "reference"))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("m", MESHES[1:], ids=mesh_id)
def test_lm_head_vh_layout_with_bias(m, impl):
    """With the head's H split over the last batch axis (``head_axes``, FSDP weights): the
    xla head keeps it split (its blocks gathered when used), pallas gathers it whole first."""
    _check(*_sharded_head(m, FEW[2], impl, layout="vh", bias=True, fsdp=True))


def test_lm_head_pallas_takes_each_shard_as_a_tpu_stores_it(monkeypatch):
    """H=256, V=400 over tp=4: each [256, 100] shard is one a TPU keeps H-minor
    (ops.core.tpu.row_major_by_default), so each device's kernels take W^T as a "vh" head
    (the spy sees it) and dW comes back in the shard's own orientation, equal to one device's."""
    from grpo_kernels.ops.lm_head_loss import pallas_tpu as head_pallas_tpu
    seen = []
    real = head_pallas_tpu.head_statistics

    def spy(*args, **kw):
        seen.append((kw["layout"], args[1].shape))
        return real(*args, **kw)

    monkeypatch.setattr(head_pallas_tpu, "head_statistics", spy)
    cfg = FEW[2]
    inp = random_head_inputs(13, 4, 5, 256, 400, jnp.float32, cfg, layout="hv")
    kw = dict(old_logps=inp.old_logps, ref_logps=inp.ref_logps)
    mesh, spec = make(MESHES[1])

    def one(h, w):
        return grpo_loss_from_hidden(h, w, inp.ids, inp.mask, inp.advantages, config=cfg,
                                     impl="reference", **kw)

    def sharded(h, w):
        return sharded_grpo_loss_from_hidden(h, w, inp.ids, inp.mask, inp.advantages,
                                             mesh=mesh, sharding=spec, config=cfg,
                                             impl="pallas", **kw)

    want = jax.value_and_grad(one, argnums=(0, 1), has_aux=True)(inp.hidden, inp.lm_head)
    _check(jax.jit(jax.value_and_grad(sharded, argnums=(0, 1), has_aux=True))(
        inp.hidden, inp.lm_head), want)
    assert seen and set(seen) == {("vh", (100, 256))}


@pytest.mark.parametrize("cfg", [FEW[0], FEW[3]], ids=cfg_id)
@pytest.mark.parametrize("m", MESHES[1:3], ids=mesh_id)
def test_lm_head_dweight_by_vocabulary_equals_one_device(m, cfg):
    """dweight="vocab" on each device's head shard: dW by vocabulary blocks of the shard."""
    blocks = LmHeadBlockSizes(dweight="vocab", chunk_tokens=16)
    _check(*_sharded_head(m, cfg, "xla", layout="vh", bias=True, options=blocks))

# --- tunix's options (aggregations over non-empty rows, clamps, dual clip, sampler weights) ---

OPTIONS = option_grid(T)
TWO_MESHES = (MESHES[1], MESHES[3])
# The row-count normalisers and the sampler weights' split need a batch axis; the vocab axis
# the whole-row statistics. Both meshes have both, the second two batch axes (the normalisers'
# psums over a tuple of axes, one code path): xla runs every option on one of them, in turn
# (each mesh meets options with and without sampler weights), pallas the tunix-like mix on
# both.
OPTION_RUNS = [("xla", i, TWO_MESHES[i // 2 % 2]) for i in range(len(OPTIONS))] + [
    ("pallas", len(OPTIONS) - 1, m) for m in TWO_MESHES]


def _option_inputs(index):
    cfg, sampler = OPTIONS[index]
    inp = random_inputs(9, B, T, V, jnp.float32, cfg, noise=0.3, sampler_weights=sampler)
    # one empty completion: the non-empty-row normalisers must count over the whole batch
    inp = inp.__class__(**{**inp.__dict__, "mask": inp.mask.at[3].set(0.0)})
    return cfg, inp


@pytest.mark.parametrize("impl,index,m", OPTION_RUNS,
                         ids=[f"{impl}-{option_id(OPTIONS[i])}-{mesh_id(m)}"
                              for impl, i, m in OPTION_RUNS])
def test_options_equal_one_device(impl, index, m):
    cfg, inp = _option_inputs(index)
    _check_logits_on_mesh(m, cfg, inp, impl)


def _check_logits_on_mesh(m, cfg, inp, impl):
    """The sharded logits loss on ``inp`` against the one-device reference."""
    mesh, spec = make(m)

    def one(z):
        return grpo_loss(z, inp.ids, inp.mask, inp.advantages, config=cfg, impl="reference",
                         **inp.kwargs())

    def sharded(z):
        return sharded_grpo_loss(z, inp.ids, inp.mask, inp.advantages, mesh=mesh,
                                 sharding=spec, config=cfg, impl=impl, **inp.kwargs())

    want = jax.value_and_grad(one, has_aux=True)(inp.logits)
    _check(jax.jit(jax.value_and_grad(sharded, has_aux=True))(inp.logits), want)


@pytest.mark.parametrize("m", (MESHES[1], MESHES[3]), ids=mesh_id)
def test_lm_head_options_equal_one_device(m):
    """The tunix-like mix with sampler weights through the sharded fused head."""
    cfg, sampler = OPTIONS[-1]
    inp = random_head_inputs(11, HB, HT, HH, HV, jnp.float32, cfg, layout="hv")
    weights = jax.random.uniform(jax.random.PRNGKey(2), inp.mask.shape, jnp.float32, 0.2, 2.0)
    kw = dict(old_logps=inp.old_logps, ref_logps=inp.ref_logps, sampler_weights=weights)
    mesh, spec = make(m)

    def one(h, w):
        return grpo_loss_from_hidden(h, w, inp.ids, inp.mask, inp.advantages, config=cfg,
                                     impl="reference", **kw)

    def sharded(h, w):
        return sharded_grpo_loss_from_hidden(h, w, inp.ids, inp.mask, inp.advantages,
                                             mesh=mesh, sharding=spec, config=cfg, impl="xla",
                                             **kw)

    want = jax.value_and_grad(one, argnums=(0, 1), has_aux=True)(inp.hidden, inp.lm_head)
    step = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1), has_aux=True))
    _check(step(inp.hidden, inp.lm_head), want)


# --- the 2026 family: loss types, sampler corrections, masks, entropy terms ------------------

FAMILY = family_grid(T)
# xla runs every variant at both levels, one level on the mesh with batch and vocab axes and
# the other on the 3-axis one (family_grid lists a variant's token and sequence configs in
# turn): every variant meets both meshes, each mesh both levels. pallas runs the entropy
# variants (the term its kernels add) on one mesh.
FAMILY_RUNS = ([("xla", i, TWO_MESHES[(i // 2 + i) % 2]) for i in range(len(FAMILY))]
               + [("pallas", i, MESHES[1]) for i, c in enumerate(FAMILY) if c.entropy_coef != 0])


@pytest.mark.parametrize("impl,index,m", FAMILY_RUNS,
                         ids=[f"{impl}-{family_id(FAMILY[i])}-{mesh_id(m)}"
                              for impl, i, m in FAMILY_RUNS])
def test_family_equals_one_device(impl, index, m):
    """The entropy quantile over the whole batch (all_gather over the batch axes), the entropy
    gradient through the vocab split, the sequence masks over split rows."""
    cfg, inp = _family_inputs(index)
    _check_logits_on_mesh(m, cfg, inp, impl)


def _family_inputs(index):
    cfg = FAMILY[index]
    inp = random_inputs(10, B, T, V, jnp.float32, cfg, noise=0.3)
    return cfg, inp.__class__(**{**inp.__dict__, "mask": inp.mask.at[3].set(0.0)})


# Token-separable configs whose normalisers need the whole batch: tunix's non-empty-row
# aggregations with sampler weights, luspo's B, cispo's token count, the entropy bonus's h.
ONE_PASS_CASES = [("option", 1), ("option", 3), ("family", 0), ("family", 6), ("family", 16)]


def _case_id(kind, index):
    return f"{kind}-{option_id(OPTIONS[index]) if kind == 'option' else family_id(FAMILY[index])}"


@pytest.mark.parametrize("kind,index", ONE_PASS_CASES,
                         ids=[_case_id(*c) for c in ONE_PASS_CASES])
def test_one_pass_kernel_over_batch_axes_equals_one_device(monkeypatch, kind, index):
    """Without a vocab axis (dp=8) pallas runs the one-pass kernel on each device's whole
    rows, its per-token weights and the loss normalised over the whole batch (psums of the
    mask); with one (dp=2 x tp=4) it runs the two kernels, since a shard lacks the row's lse.
    One row of the batch is empty, so the non-empty-row counts differ per device."""
    calls = []
    real = pallas_tpu.one_pass

    def spy(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(pallas_tpu, "one_pass", spy)
    cfg, inp = _option_inputs(index) if kind == "option" else _family_inputs(index)
    _check_logits_on_mesh(MESHES[0], cfg, inp, "pallas")
    assert calls, "the one-pass kernel did not run"
    calls.clear()
    _check_logits_on_mesh(MESHES[1], cfg, inp, "pallas")
    assert not calls


def test_one_pass_forced_on_a_vocabulary_split_is_refused():
    inp, kw, _ = _logits_case(FEW[0])
    mesh, spec = make(MESHES[1])
    with pytest.raises(ValueError, match="one_pass=True needs whole vocabulary rows.*'tp'"):
        sharded_grpo_loss(inp.logits, inp.ids, inp.mask, inp.advantages, mesh=mesh,
                          sharding=spec, config=FEW[0], impl="pallas",
                          options=PallasOptions(one_pass=True), **kw)


def _xla_one_pass(z, ids, columns, row_grad, tau, blocks, interpret=False, alias_logits=False,
                  softcap=None):
    """pallas_tpu.one_pass's contract in plain XLA (ops/logits_loss/xla.py's pieces)."""
    n, v = z.shape
    stats, grad = logits_xla.pieces((1, n, v), None, tau, softcap)
    logp, lse, ent = (x.reshape(n) for x in stats((z[None],), ids[None]))
    rg = row_grad(logp, {k: c for k, c in columns.items() if c is not None})
    rg = RowGrad(rg.g, rg.h, None if rg.h is None else ent).over(tau)
    (dz,) = grad((z[None],), ids[None], lse[None], rg.map(lambda x: x.reshape(1, n)))
    return logp, ent, dz[0]


def _xla_row_statistics(z, ids, tau, blocks, interpret=False, softcap=None):
    n, v = z.shape
    out = logits_xla.pieces((1, n, v), None, tau, softcap)[0]((z[None],), ids[None])
    return tuple(x.reshape(n) for x in out)


@pytest.mark.parametrize("index", [0, 16], ids=lambda i: family_id(FAMILY[i]))
def test_one_pass_gradient_under_vma_typing(monkeypatch, index):
    """The one-pass path under shard_map's varying-axes typing (check_vma=True, as compiled
    kernels run), which interpreted Pallas cannot use: the kernel swapped for the same
    contract in plain XLA, so the gradient's carrier and its batch_sum are checked as a TPU
    runs them. Under this typing a psum's cotangent is not split over the devices, so a
    carrier that did not vary over the batch axes would come back 8 times too large."""
    monkeypatch.setattr(pallas_tpu, "one_pass", _xla_one_pass)
    monkeypatch.setattr(pallas_tpu, "row_statistics", _xla_row_statistics)
    cfg, inp = _family_inputs(index)
    assert token_separable(cfg)
    mesh, spec = make(MESHES[0])
    opts = PallasOptions(kernel="tpu", interpret=False)

    def sharded(z):
        return sharded_grpo_loss(z, inp.ids, inp.mask, inp.advantages, mesh=mesh,
                                 sharding=spec, config=cfg, impl="pallas", options=opts,
                                 **inp.kwargs())

    def one(z):
        return grpo_loss(z, inp.ids, inp.mask, inp.advantages, config=cfg, impl="reference",
                         **inp.kwargs())

    want = jax.value_and_grad(one, has_aux=True)(inp.logits)
    _check(jax.jit(jax.value_and_grad(sharded, has_aux=True))(inp.logits), want)


HEAD_FAMILY = [c for c in FAMILY if c.entropy_coef != 0]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("cfg", HEAD_FAMILY, ids=family_id)
def test_lm_head_family_equals_one_device(cfg, impl):
    """The entropy gradient through the fused head with a vocab-split head (2 x 4 mesh)."""
    inp = random_head_inputs(12, HB, HT, HH, HV, jnp.float32, cfg, layout="hv")
    mesh, spec = make(MESHES[1])

    def one(h, w):
        return grpo_loss_from_hidden(h, w, inp.ids, inp.mask, inp.advantages, config=cfg,
                                     impl="reference", **inp.kwargs())

    def sharded(h, w):
        return sharded_grpo_loss_from_hidden(h, w, inp.ids, inp.mask, inp.advantages,
                                             mesh=mesh, sharding=spec, config=cfg, impl=impl,
                                             **inp.kwargs())

    want = jax.value_and_grad(one, argnums=(0, 1), has_aux=True)(inp.hidden, inp.lm_head)
    step = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1), has_aux=True))
    _check(step(inp.hidden, inp.lm_head), want)


# --- sequence-parallel fused head (xla: hidden split over T on the vocab axis) ---------------

SEQ_T = 8  # divisible by every vocab axis of MESHES


def _time_axis(x):
    """The mesh axis that splits axis 1 of ``x`` (``None``: whole)."""
    return (tuple(x.sharding.spec) + (None, None))[1]

SEQ_RUNS = ([(m, c, "hv", False) for m, c in zip(MESHES[1:], FEW[:3])]
            + [(MESHES[1], FEW[3], "vh", True)]
            + [(MESHES[2 + i % 2], c, "hv", i % 2 == 1) for i, c in enumerate(HEAD_FAMILY)])


@pytest.mark.parametrize(
    "m,cfg,layout,bias", SEQ_RUNS,
    ids=[f"{mesh_id(m)}-{family_id(c)}-{c.loss_type}-{lay}{'-bias' * b}"
         for m, c, lay, b in SEQ_RUNS])
def test_lm_head_sequence_parallel_equals_one_device(m, cfg, layout, bias):
    """T divisible by the vocab axis: the xla head takes hidden split over T there, gathers
    each chunk's rows and scatters its dhidden back (12-row chunks on the 2 x 4 mesh: two and
    a ragged tail). dhidden comes back split over T, equal to the one-device reference."""
    inp = random_head_inputs(13, HB, SEQ_T, HH, HV, jnp.float32, cfg, layout=layout)
    b = (jax.random.normal(jax.random.PRNGKey(6), (HV,)) * 0.5) if bias else None
    kw = {**inp.kwargs(), "lm_head_layout": layout}
    mesh, spec = make(m)

    def one(h, w, bb):
        return grpo_loss_from_hidden(h, w, inp.ids, inp.mask, inp.advantages, config=cfg,
                                     impl="reference", bias=bb, **kw)

    def sharded(h, w, bb):
        return sharded_grpo_loss_from_hidden(
            h, w, inp.ids, inp.mask, inp.advantages, mesh=mesh, sharding=spec, config=cfg,
            impl="xla", bias=bb, options=LmHeadBlockSizes(chunk_tokens=12), **kw)

    argnums = (0, 1, 2) if bias else (0, 1)
    want = jax.value_and_grad(one, argnums=argnums, has_aux=True)(inp.hidden, inp.lm_head, b)
    got = jax.jit(jax.value_and_grad(sharded, argnums=argnums, has_aux=True))(
        inp.hidden, inp.lm_head, b)
    assert _time_axis(got[1][0]) == "tp"  # the sequence-parallel path ran
    _check(got, want)


def test_lm_head_time_not_divisible_keeps_hidden_whole():
    """T = 5 over a vocab axis of 4: hidden stays whole on the vocab axis, dhidden summed."""
    got, want = _sharded_head(MESHES[1], FEW[0], "xla")
    assert _time_axis(got[1][0]) is None
    _check(got, want)


@pytest.mark.default_emitters
def test_long_sequence_per_device_temporaries():
    """Long sequences (compile-only; H=4096, V=151,936 bf16, vocab split 8 ways):
    per-device temporaries at T=131,072 within 1% of those at T=8,192, and at most 1.2/8 of
    one device's at T=131,072 (docs/lm_head.md, "Long sequences")."""
    from tests.ops.lm_head_loss.test_long_sequence import planned_temp
    short, long = (planned_temp(t, 4096, 151936, vocab_shards=8) for t in (8192, 131072))
    one = planned_temp(131072, 4096, 151936)
    assert long <= 1.01 * short, (short, long)
    assert long <= 1.2 / 8 * one, (long, one)


# (mesh, head axes, config, layout, bias): the head's H split over batch axes (FSDP weights);
# the "vh" layout with a bias and one head axis: test_lm_head_vh_layout_with_bias.
FSDP_RUNS = [(((2, 2, 2), ("dp", "fsdp", "tp")), ("dp", "fsdp"), FEW[1], "hv", False),
             (((4, 2), ("fsdp", "tp")), ("fsdp",), HEAD_FAMILY[0], "hv", True),
             (((8, 1), ("fsdp", "tp")), ("fsdp",), FEW[3], "vh", False)]


@pytest.mark.parametrize("m,head_axes,cfg,layout,bias", FSDP_RUNS,
                         ids=[f"{mesh_id(r[0])}-h{'+'.join(r[1])}-{r[3]}" for r in FSDP_RUNS])
def test_lm_head_fsdp_weights_equal_one_device(m, head_axes, cfg, layout, bias):
    """``ShardingSpec.head_axes``: the head arrives with H split over batch axes, as tunix
    places it, and stays so (each vocabulary block gathered when used, its dW reduce-scattered
    back); the weight gradient comes back in that layout, equal to one device's (with a bias,
    an entropy bonus, both layouts, two head axes, a vocab axis of 2 and of 1)."""
    inp, kw, argnums, want = _head_case(cfg, layout, bias)
    mesh = mesh_from_shape(*m)
    spec = ShardingSpec(tuple(n for n in m[1] if n != "tp"), "tp", head_axes)

    def fn(h, w, bb):
        return sharded_grpo_loss_from_hidden(h, w, inp.ids, inp.mask, inp.advantages,
                                             mesh=mesh, sharding=spec, config=cfg, impl="xla",
                                             **{**kw, "bias": bb})

    w = jax.device_put(inp.lm_head, NamedSharding(mesh, spec.on(mesh).head(layout)))
    got = jax.jit(jax.value_and_grad(fn, argnums=argnums, has_aux=True))(
        inp.hidden, w, kw["bias"])
    assert got[1][1].sharding.spec == spec.on(mesh).head(layout)
    _check(got, want)


@pytest.mark.default_emitters
def test_fsdp_head_is_gathered_by_blocks():
    """Compile-only, bf16, mesh fsdp 4 x tp 2, H = 1024, V = 32,768: with ``head_axes`` no
    collective moves a quarter of a device's ``[H, V/2]`` shard (without them, the shard is
    gathered whole and its gradient all-reduced whole), and the per-device plan is under a
    third of the whole-shard one."""
    cfg = GRPOLossConfig(beta=0.04)
    b, t, h, v = 4, 512, 1024, 32768
    inp = random_head_inputs(0, b, t, h, v, jnp.bfloat16, cfg)
    mesh = mesh_from_shape((4, 2), ("fsdp", "tp"))
    fsdp = ShardingSpec(("fsdp",), "tp", ("fsdp",))
    placed = (jax.device_put(inp.hidden, NamedSharding(mesh, fsdp.rows(3))),
              jax.device_put(inp.lm_head, NamedSharding(mesh, fsdp.head("hv"))))
    plans = {}
    for spec in (fsdp, fsdp.whole_head()):
        def fn(hh, w, spec=spec):
            return sharded_grpo_loss_from_hidden(
                hh, w, inp.ids, inp.mask, inp.advantages, config=cfg, impl="xla", mesh=mesh,
                sharding=spec, old_logps=inp.old_logps, ref_logps=inp.ref_logps)
        step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))
        compiled = step.lower(*placed).compile()
        plans[spec.head_axes] = (compiled.memory_analysis().temp_size_in_bytes,
                                 max(e for _, e in _collective_sizes(compiled)))
    shard = h * v // 2
    assert plans[()][1] >= shard  # the whole shard crosses devices without head axes
    assert plans[("fsdp",)][1] < shard // 4, plans
    assert plans[("fsdp",)][0] < plans[()][0] / 3, plans


# --- layouts, collectives, errors ------------------------------------------------------------

def _collective_sizes(compiled):
    return [(c.op, c.elements) for c in collectives(compiled.as_text())]


@pytest.mark.default_emitters
def test_inputs_in_any_layout_and_no_vocab_sized_collective():
    """Inputs arrive sharded another way under jit; no collective of logits size appears."""
    m = MESHES[3]
    mesh, spec = make(m)
    cfg = CONFIGS[1]
    inp, kw, want = _logits_case(cfg)
    put = lambda x, p: jax.device_put(x, NamedSharding(mesh, p))
    # logits with B over tp and V over (dp, fsdp): not the op's layout; the rest replicated
    z = put(inp.logits, P("tp", None, ("dp", "fsdp")))
    args = [put(x, P()) for x in (inp.ids, inp.mask, inp.advantages)]
    kw = {k: put(v, P()) if hasattr(v, "shape") else v for k, v in kw.items()}

    def fn(z, ids, mask, adv):
        return sharded_grpo_loss(z, ids, mask, adv, mesh=mesh, sharding=spec, config=cfg,
                                 impl="xla", **kw)

    step = jax.jit(jax.value_and_grad(fn, has_aux=True))
    _check(step(z, *args), want)
    # In the op's own layout: only [B, T]-sized collectives (nothing of V).
    z = put(inp.logits, spec.logits())
    rows = [put(inp.ids, spec.rows(2)), put(inp.mask, spec.rows(2)),
            put(inp.advantages, spec.rows(1))]
    sizes = _collective_sizes(step.lower(z, *rows).compile())
    assert sizes, "expected the psum/pmax statistics collectives"
    assert max(e for _, e in sizes) <= B * T, sizes
    assert not [op for op, _ in sizes if op == "all-gather"], sizes


@pytest.mark.parametrize("m", MESHES, ids=mesh_id)
@pytest.mark.default_emitters
def test_lm_head_collectives_are_never_logits_sized(m):
    mesh, spec = make(m)
    cfg = CONFIGS[0]
    inp, kw, _, _ = _head_case(cfg, "hv", False)

    def fn(h, w):
        return sharded_grpo_loss_from_hidden(h, w, inp.ids, inp.mask, inp.advantages,
                                             mesh=mesh, sharding=spec, config=cfg, impl="xla",
                                             **kw)

    step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))
    sizes = _collective_sizes(step.lower(inp.hidden, inp.lm_head).compile())
    vocab_shard = HV // spec.vocab_shards(mesh)
    rows = HB * HT // spec.batch_shards(mesh)
    # the largest is dW (a [H, V/k] shard, summed over the batch axes) or dh ([rows, H] at
    # most, summed over the vocab axis); nothing of [rows, V/k]
    assert max(e for _, e in sizes) <= max(HH * vocab_shard, rows * HH), sizes
    assert not [op for op, _ in sizes if op == "all-gather"], sizes


@pytest.mark.default_emitters
def test_fused_per_device_temp_scales_with_the_vocab_axis():
    """bench --mesh's figure: per-device temp x k <= 1.2 x one device (k = 8, bf16)."""
    cfg = GRPOLossConfig(beta=0.04)
    b, t, h, v = 2, 1024, 512, 32768
    inp = random_head_inputs(0, b, t, h, v, jnp.bfloat16, cfg)
    mesh, spec = make(MESHES[2])

    def temp(op, args, **kw):
        def fn(hh, w):
            return op(hh, w, inp.ids, inp.mask, inp.advantages, config=cfg, impl="xla",
                      old_logps=inp.old_logps, ref_logps=inp.ref_logps, **kw)
        step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))
        return step.lower(*args).compile().memory_analysis().temp_size_in_bytes

    one = temp(grpo_loss_from_hidden, (inp.hidden, inp.lm_head))
    placed = (jax.device_put(inp.hidden, NamedSharding(mesh, spec.rows(3))),
              jax.device_put(inp.lm_head, NamedSharding(mesh, spec.head("hv"))))
    per_device = temp(sharded_grpo_loss_from_hidden, placed, mesh=mesh, sharding=spec)
    assert per_device * 8 <= 1.2 * one, (per_device, one)


def test_divisibility_and_spec_errors_name_the_problem():
    mesh, spec = make(MESHES[1])  # dp=2, tp=4
    cfg = GRPOLossConfig()
    inp = random_inputs(0, 3, 4, 64, jnp.float32, cfg)
    with pytest.raises(ValueError, match=r"B=3 .*not divisible by the batch axes"):
        sharded_grpo_loss(inp.logits, inp.ids, inp.mask, inp.advantages, mesh=mesh,
                          sharding=spec, config=cfg)
    inp = random_inputs(0, 4, 4, 66, jnp.float32, cfg)
    with pytest.raises(ValueError, match=r"V=66 .*not divisible by the vocab axis 'tp' of size 4"):
        sharded_grpo_loss(inp.logits, inp.ids, inp.mask, inp.advantages, mesh=mesh,
                          sharding=spec, config=cfg)
    hin = random_head_inputs(0, 4, 4, 16, 66, jnp.float32, cfg)
    with pytest.raises(ValueError, match=r"V=66 of hidden/lm_head"):
        sharded_grpo_loss_from_hidden(hin.hidden, hin.lm_head, hin.ids, hin.mask,
                                      hin.advantages, mesh=mesh, sharding=spec, config=cfg)
    inp = random_inputs(0, 4, 4, 64, jnp.float32, cfg)
    with pytest.raises(ValueError, match=r"mesh axis 'mp', but the mesh has axes \('dp', 'tp'\)"):
        sharded_grpo_loss(inp.logits, inp.ids, inp.mask, inp.advantages, mesh=mesh,
                          sharding=ShardingSpec("dp", "mp"), config=cfg)
    with pytest.raises(ValueError, match="sharding must be a ShardingSpec"):
        sharded_grpo_loss(inp.logits, inp.ids, inp.mask, inp.advantages, mesh=mesh,
                          sharding=("dp", "tp"), config=cfg)
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
        sharded_grpo_loss(inp.logits, inp.ids, inp.mask, inp.advantages, mesh="dp",
                          sharding=spec, config=cfg)
    spec_h = ShardingSpec(("dp",), "tp", ("dp",))
    hin = random_head_inputs(0, 4, 4, 15, 64, jnp.float32, cfg)
    with pytest.raises(ValueError, match=r"H=15 of hidden/lm_head is not divisible by the head "
                                         r"axes \{'dp': 2\}"):
        sharded_grpo_loss_from_hidden(hin.hidden, hin.lm_head, hin.ids, hin.mask,
                                      hin.advantages, mesh=mesh, sharding=spec_h, config=cfg,
                                      impl="xla")
    with pytest.raises(ValueError, match="logits must have rank 3"):
        sharded_grpo_loss(inp.logits[0], inp.ids, inp.mask, inp.advantages, mesh=mesh,
                          sharding=spec, config=cfg)


def test_sharding_spec_validation():
    with pytest.raises(ValueError, match="also one of batch_axes"):
        ShardingSpec(("dp", "tp"), "tp")
    with pytest.raises(ValueError, match="repeated axis"):
        ShardingSpec(("dp", "dp"))
    with pytest.raises(ValueError, match="mesh axis names"):
        ShardingSpec((1,))
    assert ShardingSpec("dp").batch_axes == ("dp",)
    with pytest.raises(ValueError, match="head_axes must be distinct batch axes"):
        ShardingSpec(("dp",), "tp", ("fsdp",))
    assert ShardingSpec(("dp", "fsdp"), None, "fsdp").head_axes == ("fsdp",)
    with pytest.raises(ValueError, match="needs 16 devices, only 8 present"):
        mesh_from_shape((4, 4), ("dp", "tp"))


def test_a_call_outside_jit_compiles_one_program(caplog):
    """Called eagerly, a sharded entry compiles its shard_map as one program (not its body's
    operations one by one; the log-prob op clamps the ids before it, as on one device), and a
    second call with the same statics compiles nothing."""
    mesh, spec = make(MESHES[1])
    cfg = GRPOLossConfig(beta=0.04, max_completion_length=T + 2)

    def placed(x):  # in the op's layout already, so that the call moves nothing
        return jax.device_put(x, NamedSharding(mesh, spec.logits() if x.ndim == 3 else
                                               spec.rows(x.ndim)))

    inp = random_inputs(21, B, T, V, jnp.float32, cfg)
    inp = inp.__class__(**{k: None if v is None else placed(v) for k, v in inp.__dict__.items()})
    hin = random_head_inputs(22, HB, HT, HH, HV, jnp.float32, cfg)
    hin = dataclasses.replace(hin, hidden=jax.device_put(hin.hidden, NamedSharding(
        mesh, spec.rows(3))), lm_head=jax.device_put(hin.lm_head, NamedSharding(
            mesh, spec.head("hv"))), ids=placed(hin.ids))
    calls = {
        "loss": lambda: sharded_grpo_loss(inp.logits, inp.ids, inp.mask, inp.advantages,
                                          mesh=mesh, sharding=spec, config=cfg, impl="xla",
                                          **inp.kwargs())[0],
        "head_logps": lambda: sharded_token_logps_from_hidden(
            hin.hidden, hin.lm_head, hin.ids, mesh=mesh, sharding=spec, impl="xla")}
    for name, call in calls.items():
        counts = []
        for _ in range(2):
            caplog.clear()
            with caplog.at_level(logging.WARNING), jax.log_compiles():
                jax.block_until_ready(call())
            compiled = [r.getMessage().split()[1] for r in caplog.records
                        if r.getMessage().startswith("Compiling")]
            counts.append((compiled.count("jit(_run)"), len(compiled)))
        assert counts[0][0] == 1 and counts[0][1] <= 2 and counts[1] == (0, 0), (name, counts)


@pytest.mark.parametrize("op", ["logits", "lm_head"])
def test_tpu_kernels_lower_under_shard_map(op):
    """value_and_grad on a (2, 2, 2) mesh with check_vma on lowers to Mosaic kernels at V =
    151,936 and H = 4096 (bf16), each device holding [B/4, T, V/2]."""
    mesh, spec = make(MESHES[3])
    cfg = GRPOLossConfig(beta=0.04)
    b, t, h, v = 4, 256, 4096, 151_936

    def s(shape, dtype, p):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, p))

    rows = [s((b, t), jnp.int32, spec.rows(2)), s((b, t), jnp.float32, spec.rows(2)),
            s((b,), jnp.float32, spec.rows(1)), s((b, t), jnp.float32, spec.rows(2))]
    if op == "logits":
        args = [s((b, t, v), jnp.bfloat16, spec.logits())] + rows

        def f(z, ids, mask, adv, ref):
            return sharded_grpo_loss(z, ids, mask, adv, mesh=mesh, sharding=spec, config=cfg,
                                     impl="pallas", ref_logps=ref,
                                     options=PallasOptions(kernel="tpu", interpret=False))
        argnums, kernels = (0,), 2
    else:
        args = [s((b, t, h), jnp.bfloat16, spec.rows(3)),
                s((h, v), jnp.bfloat16, spec.head("hv"))] + rows

        def f(hh, w, ids, mask, adv, ref):
            return sharded_grpo_loss_from_hidden(
                hh, w, ids, mask, adv, mesh=mesh, sharding=spec, config=cfg, impl="pallas",
                ref_logps=ref, options=LmHeadPallasOptions(interpret=False))
        argnums, kernels = (0, 1), 3
    step = jax.jit(jax.value_and_grad(f, argnums=argnums, has_aux=True))
    with every_platform():
        exported = jax.export.export(step, platforms=["tpu"])(*args)
    assert exported.mlir_module().count("tpu_custom_call") == kernels
    assert exported.nr_devices == 8


# --- TRL 1.16's corners: LUSPO's aggregation, the entropy bonus beside num_items_in_batch ----

def _corner_runs():
    from tests.ops.test_trl_corners import CORNERS
    return [(op, impl, i) for i in range(len(CORNERS)) for op, impl in (
        ("logits", "xla"), ("lm_head", "xla"),
        *([("logits", "pallas")] if CORNERS[i].entropy_coef != 0 else []))]


CORNER_RUNS = _corner_runs()


@pytest.mark.parametrize("op,impl,index", CORNER_RUNS,
                         ids=[f"{op}-{impl}-{i}" for op, impl, i in CORNER_RUNS])
def test_trl_corners_equal_the_oracle_on_a_mesh(op, impl, index):
    """tests/ops/test_trl_corners.py's corners through the sharded ops (batch and vocab axes):
    the value equals the float64 oracle of TRL 1.16's formula, everything else the one-device
    reference. Row 3 is empty, so the normalisers meet an empty sequence."""
    from tests.ops.test_trl_corners import CORNERS, NUM_ITEMS, _oracle_of
    cfg = CORNERS[index]
    mesh, spec = make(MESHES[1])
    if op == "logits":
        inp = random_inputs(60 + index, B, T, V, jnp.float32, cfg, noise=0.3)
        args, argnums = (inp.logits,), 0
        logits = as64(inp.logits)
        one_fn, sharded_fn = grpo_loss, sharded_grpo_loss
    else:
        inp = random_head_inputs(60 + index, HB, HT, HH, HV, jnp.float32, cfg, layout="hv")
        args, argnums = (inp.hidden, inp.lm_head), (0, 1)
        logits = as64(inp.hidden) @ as64(inp.lm_head)
        one_fn, sharded_fn = grpo_loss_from_hidden, sharded_grpo_loss_from_hidden
    mask = inp.mask.at[3].set(0.0)
    kw = dict(old_logps=inp.old_logps, ref_logps=inp.ref_logps, num_items_in_batch=NUM_ITEMS,
              config=cfg)

    def one(*a):
        return one_fn(*a, inp.ids, mask, inp.advantages, impl="reference", **kw)

    def sharded(*a):
        return sharded_fn(*a, inp.ids, mask, inp.advantages, mesh=mesh, sharding=spec,
                          impl=impl, **kw)

    want = jax.value_and_grad(one, argnums=argnums, has_aux=True)(*args)
    got = jax.jit(jax.value_and_grad(sharded, argnums=argnums, has_aux=True))(*args)
    _check(got, want)
    np.testing.assert_allclose(float(got[0][0]), _oracle_of(
        logits, inp.ids, mask, inp.advantages, cfg, inp.old_logps, inp.ref_logps),
        rtol=2e-5, atol=1e-6)


# --- packed rows (segments) ------------------------------------------------------------------

@pytest.mark.parametrize("op,impl", [("logits", "xla"), ("logits", "pallas"), ("lm_head", "xla"),
                                     ("lm_head", "pallas"), ("lm_head-seq", "xla")])
def test_packed_rows_equal_one_device(op, impl):
    """Packed rows (segment ids, per-token advantages), gspo-token and the per-segment
    aggregation, on the 2 x 4 mesh: rows whole on each device, each segment's sums local, the
    active-segment count summed over the batch axes. ``lm_head-seq``: the xla head
    sequence-parallel (T split over the vocab axis)."""
    from grpo_kernels import Segments
    from tests.objective.test_segments import packed_batch

    ids, mask, adv, seg, _ = packed_batch(3, rows=B, length=SEQ_T * 2, vocab=HV,
                                          segments_per_row=(3, 2, 1, 2, 3, 1, 2, 2))
    cfg = GRPOLossConfig(loss_agg_mode="sequence-mean-token-mean", beta=0.04,
                         importance_sampling_level="sequence_token", sequence_log_ratio_max=0.05)
    k = jax.random.split(jax.random.key(4), 4)
    old = jax.random.normal(k[1], ids.shape) * 0.3 - 5.0
    kw = dict(config=cfg, old_logps=old, ref_logps=old + 0.1, segments=Segments(seg, 5))
    mesh, spec = make(MESHES[1])
    if op == "logits":
        z = jax.random.normal(k[0], (*ids.shape, HV)) * 2.0
        want = jax.value_and_grad(lambda z: grpo_loss(z, ids, mask, adv, impl="reference",
                                                      **kw), has_aux=True)(z)
        got = jax.jit(jax.value_and_grad(lambda z: sharded_grpo_loss(
            z, ids, mask, adv, mesh=mesh, sharding=spec, impl=impl, **kw), has_aux=True))(z)
    else:
        h = jax.random.normal(k[2], (*ids.shape, HH))
        w = jax.random.normal(k[3], (HH, HV)) * 0.3
        opts = LmHeadBlockSizes(chunk_tokens=12) if op == "lm_head-seq" else None
        want = jax.value_and_grad(lambda h, w: grpo_loss_from_hidden(
            h, w, ids, mask, adv, impl="reference", **kw), argnums=(0, 1), has_aux=True)(h, w)
        got = jax.jit(jax.value_and_grad(lambda h, w: sharded_grpo_loss_from_hidden(
            h, w, ids, mask, adv, mesh=mesh, sharding=spec, impl=impl, options=opts, **kw),
            argnums=(0, 1), has_aux=True))(h, w)
        if op == "lm_head-seq":
            assert _time_axis(got[1][0]) == "tp"
    _check(got, want)
