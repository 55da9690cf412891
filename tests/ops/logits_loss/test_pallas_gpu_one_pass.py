"""The one-pass GPU kernel (``pallas_gpu_one_pass``), interpreted: against the reference over the
token-separable configs and the aligned addressing's odd shapes, against the two kernels on
masked and NaN logits, its dispatch, and lowered for CUDA.

The generic interpreter pads inputs with NaN, so a read past a row's end would show up as a NaN
loss or gradient, which ``assert_matches_reference`` rejects.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

from grpo_kernels import GRPOLossConfig, PallasBlockSizes, PallasOptions, grpo_loss
from grpo_kernels.objective import token_row_grad, token_separable
from grpo_kernels.ops.logits_loss import pallas_gpu_one_pass as one_pass
from grpo_kernels.ops.logits_loss.inputs import random_inputs
from tests.helpers import (cuda_module, dtype_id, family_grid, family_id, grid_id,
                           loss_grid_split, option_grid, option_id, reference_value_and_grad,
                           rel_err)
from tests.ops.logits_loss.test_impls import assert_matches_reference
from tests.ops.logits_loss.test_pallas import kernel_names
from tests.ops.logits_loss.test_pallas_gpu_aligned import SHAPES


def _options(block_vocab: int = 128, programs: int | None = 4, stages: int | None = None,
             **kw) -> PallasOptions:
    """Four programs by default: the 21 rows below leave them 6, 5, 5 and 5 rows."""
    return PallasOptions(kernel="gpu", one_pass=True, blocks=PallasBlockSizes(
        block_vocab=block_vocab, gpu_programs=programs, gpu_stages=stages), **kw)


# Token level only (the kernel's domain); delta stays in, since the kernel now forms g itself.
# Every other config of the split keeps the test time down; each factor's levels still meet.
GRID = [(c, d) for c, d in loss_grid_split(7) if c.importance_sampling_level == "token"][::2]


@pytest.mark.parametrize("cfg,dtype", [pytest.param(c, d, id=f"{grid_id(c)}-{dtype_id(d)}")
                                       for c, d in GRID])
def test_grid_matches_reference(cfg, dtype):
    inp = random_inputs(31, 3, 7, 1000, dtype, cfg)
    assert_matches_reference("pallas", inp, cfg, options=_options())


OPTIONS = [(i, o) for i, o in enumerate(option_grid(7)) if token_separable(o[0])]
FAMILY = [c for c in family_grid(7) if token_separable(c)]


@pytest.mark.parametrize("index,item", OPTIONS, ids=[option_id(o) for _, o in OPTIONS])
def test_options_match_reference(index, item):
    """tunix's options and sampler weights: the objective's code inside the kernel."""
    cfg, sampler = item
    dtype = (jnp.float32, jnp.bfloat16)[index % 2]
    inp = random_inputs(32, 3, 7, 300, dtype, cfg, noise=0.3, sampler_weights=sampler)
    assert_matches_reference("pallas", inp, cfg, options=_options())


@pytest.mark.parametrize("index", range(len(FAMILY)), ids=[family_id(c) for c in FAMILY])
def test_family_matches_reference(index):
    """The token-separable part of the 2026 family (CISPO, SAPO, token-level sampler
    correction, the entropy bonus, KL bias correction)."""
    cfg = FAMILY[index]
    dtype = (jnp.float32, jnp.bfloat16)[index % 2]
    inp = random_inputs(33, 3, 7, 300, dtype, cfg, noise=0.3)
    assert_matches_reference("pallas", inp, cfg, options=_options())


@pytest.mark.parametrize("index", range(len(SHAPES)),
                         ids=[f"{b}x{t}x{v}-{dtype_id(d)}" for b, t, v, d in SHAPES])
def test_odd_shapes_match_reference(index):
    """The aligned addressing's shapes (every head length, zero to two full tiles, rows
    shorter than a vector), with programs that do not divide the rows and more programs than
    rows (the planner caps them at N), and every count of load stages: more tiles ahead than
    the row has (loads clamped to its last tile) and none."""
    b, t, v, dtype = SHAPES[index]
    cfg = GRPOLossConfig(loss_type="dapo", beta=0.04, delta=2.0, temperature=0.7,
                         entropy_coef=0.02)
    inp = random_inputs(200 + index, b, t, v, dtype, cfg)
    programs, stages = (1, 4, 64)[index % 3], (3, 4, 1, 2)[index % 4]
    assert_matches_reference("pallas", inp, cfg,
                             options=_options(programs=programs, stages=stages))


def test_dlogits_into_the_donated_logits_buffer():
    cfg = GRPOLossConfig(loss_type="bnpo", entropy_coef=0.05)
    inp = random_inputs(8, 4, 8, 300, jnp.bfloat16, cfg)
    _, _, want = reference_value_and_grad(inp, cfg)
    opts = _options(alias_logits=True, programs=3)

    def fn(z):
        return grpo_loss(z, inp.ids, inp.mask, inp.advantages, config=cfg, impl="pallas",
                         options=opts, **inp.kwargs())[0]

    _, got = jax.jit(jax.value_and_grad(fn), donate_argnums=0)(inp.logits + 0)
    assert got.dtype == jnp.bfloat16 and rel_err(got, want) <= 1e-2


def _loss_and_grad(z, inp, cfg, options):
    def fn(z):
        return grpo_loss(z, inp.ids, inp.mask, inp.advantages, config=cfg, impl="pallas",
                         options=options, **inp.kwargs())
    (loss, metrics), dz = jax.value_and_grad(fn, has_aux=True)(z)
    return loss, metrics["logp"], dz


def test_masked_vocabulary_and_nan_as_the_two_kernels():
    """-inf logits (heads, tiles and tails) contribute nothing, as in the two kernels; a NaN
    logit makes its token's log-prob NaN."""
    cfg = GRPOLossConfig(beta=0.04, entropy_coef=0.01)
    inp = random_inputs(9, 3, 3, 300, jnp.float32, cfg)
    cols = jnp.arange(300)[None, None, :]
    z = jnp.where((cols % 3 == 0) & (cols != inp.ids[..., None]), -jnp.inf, inp.logits)
    two = PallasOptions(kernel="gpu", gpu_layout="aligned",
                        blocks=PallasBlockSizes(block_vocab=128))
    got, want = (_loss_and_grad(z, inp, cfg, o) for o in (_options(), two))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-7)
    assert bool(jnp.all(jnp.where(cols[..., ::3] != inp.ids[..., None], got[2][..., ::3], 0) == 0))
    logp = _loss_and_grad(z.at[1, 2, 150].set(jnp.nan), inp, cfg, _options())[1]
    assert np.isnan(float(logp[1, 2])) and not np.isnan(np.asarray(logp)[0]).any()


GPU_KERNELS = ("grpo_gpu_one_pass", "grpo_tile_statistics", "grpo_tile_gradient")


def test_the_one_pass_gpu_kernel_runs_only_when_asked():
    """Not faster than the aligned two kernels on an H100 (docs/benchmarks.md, "GPU: the
    aligned layout becomes the default"), so one_pass=None keeps the two kernels there; a call without a gradient needs the statistics
    alone. (The rows layout's kernel names, which say which layout ran.)"""
    gpu = PallasOptions(kernel="gpu", gpu_layout="rows")
    two = {"grpo_tile_statistics", "grpo_tile_gradient"}
    assert kernel_names(GRPOLossConfig(), gpu, GPU_KERNELS) == two
    asked = dataclasses.replace(gpu, one_pass=True)
    assert kernel_names(GRPOLossConfig(), asked, GPU_KERNELS) == {"grpo_gpu_one_pass"}
    assert kernel_names(GRPOLossConfig(), asked, GPU_KERNELS, grad=False) == {
        "grpo_tile_statistics"}


def test_plan_and_blocks():
    assert one_pass.plan_blocks(2048, 151_643, programs=None).block_vocab == 16384
    assert one_pass.plan_blocks(2048, 300).block_vocab == 512
    assert one_pass.plan_blocks(5, 300, programs=64).programs == 5
    assert one_pass.plan_blocks(5, 300).stages == 2
    assert one_pass.plan_blocks(5, 300, stages=3).stages == 3
    assert 1 <= one_pass.default_programs(3) <= 3
    for field, value in (("block_vocab", 100), ("num_warps", 6), ("programs", 0),
                         ("stages", 0), ("stages", 5), ("l2_hints", 1)):
        kw = {"block_vocab": 128, "num_warps": 4, "programs": 2, field: value}
        with pytest.raises(ValueError, match=f"OnePassBlocks.{field} must be"):
            one_pass.OnePassBlocks(**kw)
    assert one_pass.plan_blocks(5, 300).l2_hints
    with pytest.raises(ValueError, match="PallasBlockSizes.gpu_programs must be None or an int"):
        PallasBlockSizes(gpu_programs=0)
    with pytest.raises(ValueError, match=r"PallasBlockSizes.gpu_stages must be at most 4 "
                       r"\(each load stage holds a tile in registers\), got 5"):
        PallasBlockSizes(gpu_stages=5)


def _eviction_policies(jaxpr, found: collections.Counter) -> collections.Counter:
    """``(primitive, eviction_policy)`` counts of every load and store in ``jaxpr``, loop
    bodies and the kernel's own jaxpr included."""
    for e in jaxpr.eqns:
        if "eviction_policy" in e.params:
            found[e.primitive.name, e.params["eviction_policy"]] += 1
        for p in e.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(sub, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                    _eviction_policies(getattr(sub, "jaxpr", sub), found)
    return found


def test_l2_hints_keep_the_first_sweep_and_drop_the_second():
    """With ``l2_hints`` the first sweep's full tiles load as ``evict_last`` (kept in L2 for
    the second), the second sweep's loads and the dlogits stores as ``evict_first``; without,
    no load or store carries a policy. Either way the numbers are the same."""
    cfg = GRPOLossConfig(beta=0.04)
    inp = random_inputs(41, 3, 5, 300, jnp.bfloat16, cfg)
    z, ids = inp.logits.reshape(15, 300), inp.ids.reshape(15)
    cols = {"weights": jnp.full((15,), 1 / 15), "advantages": inp.advantages.repeat(5),
            "ref_logp": -jnp.abs(z[:, 0].astype(jnp.float32))}
    outs, policies = [], []
    for hints in (True, False):
        blocks = one_pass.OnePassBlocks(128, 4, 4, 2, l2_hints=hints)

        def fn(z, blocks=blocks):
            return one_pass.one_pass(z, ids, cols, lambda lp, c: token_row_grad(lp, c, cfg),
                                     0.7, blocks, interpret=True)

        policies.append(_eviction_policies(jax.make_jaxpr(fn)(z).jaxpr, collections.Counter()))
        outs.append(jax.jit(fn)(z))
    hinted = {k: v for k, v in policies[0].items() if k[1] is not None}
    # Two stages: the loop's load and the one issued ahead of it, in each sweep.
    assert hinted == {("masked_load", "evict_last"): 2, ("masked_load", "evict_first"): 2,
                      ("masked_swap", "evict_first"): 1}, policies[0]
    assert all(k[1] is None for k in policies[1]) and policies[1], policies[1]
    for a, b in zip(*outs):
        assert bool(jnp.all(jnp.isfinite(a.astype(jnp.float32))))
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_int32_offsets_are_checked():
    z = jax.ShapeDtypeStruct((16384, 151_643), jnp.bfloat16)  # B=8, T=2048: 2.48e9 elements
    ids = jnp.zeros((16384,), jnp.int32)
    cols = {"weights": jnp.zeros((16384,)), "advantages": jnp.zeros((16384,))}
    blocks = one_pass.plan_blocks(16384, 151_643, programs=132)
    with pytest.raises(ValueError, match=r"one-pass GPU kernel .* N \* V = 16384 \* 151643 .*"
                       r"PallasOptions\(one_pass=False\)"):
        jax.eval_shape(lambda z: one_pass.one_pass(z, ids, cols, None, 1.0, blocks), z)


def _export_for_cuda(cfg, b, t, v, sampler_weights=False):
    """``jax.export`` of ``value_and_grad`` on the one-pass GPU kernel, for CUDA; skips where
    this jaxlib cannot lower Triton kernels."""
    spec = jax.ShapeDtypeStruct
    row = spec((b, t), jnp.float32)
    args = (spec((b, t, v), jnp.bfloat16), spec((b, t), jnp.int32), row, spec((b,), jnp.float32),
            row)

    def f(z, ids, mask, adv, logps):
        kw = dict(ref_logps=logps) if cfg.beta else {}
        if cfg.sampler_correction is not None:
            kw["sampler_logps"] = logps
        if sampler_weights:
            kw["sampler_weights"] = jnp.exp(logps)
        return grpo_loss(z, ids, mask, adv, config=cfg, impl="pallas", old_logps=logps,
                         options=PallasOptions(kernel="gpu", one_pass=True, interpret=False),
                         **kw)

    text = cuda_module(jax.value_and_grad(f, has_aux=True), *args)
    assert text.count("__gpu$xla.gpu.triton") == 1 and "grpo_gpu_one_pass" in text


@pytest.mark.parametrize("b,t", [(1, 2048), (4, 1024)])
def test_lowers_for_cuda_at_the_benchmark_shapes(b, t):
    """value_and_grad at V = 151,643 bf16 is one Triton call."""
    _export_for_cuda(GRPOLossConfig(beta=0.04), b, t, 151_643)


LOWERED = ([(c, False) for c, _ in GRID] + [o for _, o in OPTIONS]
           + [(c, False) for c in FAMILY])


@pytest.mark.parametrize("cfg,sampler", LOWERED, ids=[
    f"{grid_id(c)}-{option_id((c, s))}-{family_id(c)}" for c, s in LOWERED])
def test_every_token_separable_config_lowers_for_cuda(cfg, sampler):
    """The objective's code, which runs per token inside the kernel, lowers to Triton for
    every config the interpret-mode tests above run (Triton lacks some of what XLA and Mosaic
    accept: SAPO's and the sampler mask's float literals once failed here)."""
    _export_for_cuda(cfg, 1, 16, 1000, sampler)
