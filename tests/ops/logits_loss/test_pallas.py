"""Pallas kernels (TPU and GPU) in interpret mode against the reference, and TPU lowering.

On CPU, ``impl="pallas"`` interprets the kernels: the TPU kernel in TPU interpret mode with
out-of-bounds reads raising (``InterpretParams(out_of_bounds_reads="raise")``), the GPU (Triton)
kernel in the generic interpreter, which pads every input with NaN, so an unmasked read past the
array would turn the compared results into NaN.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from grpo_kernels import GRPOLossConfig, PallasBlockSizes, PallasOptions, grpo_loss
from grpo_kernels.objective.gradient import RowGrad
from grpo_kernels.ops.core.tpu import GENERATIONS, VMEM_BYTES
from grpo_kernels.ops.logits_loss import pallas_tpu
from grpo_kernels.ops.logits_loss.inputs import random_inputs
from grpo_kernels.config import CLASSIC_LOSS_TYPES
from tests.helpers import (cuda_export, dtype_id, every_platform, family_grid, family_id,
                           grid_id, option_grid, option_id, pairwise, reference_value_and_grad,
                           rel_err)
from tests.ops.logits_loss.test_impls import assert_matches_reference

KERNELS = ("tpu", "gpu")
# The grid tests' vocabulary: two full 128-column tiles and a ragged third (small_blocks). The
# TPU kernel's interpreter runs grid step by grid step, so every tile more is time.
VOCAB = 300


def small_blocks(kernel: str, dtype) -> PallasOptions:
    """Blocks small enough that the test shapes have full row blocks, leftover rows, full
    vocabulary tiles and a ragged last tile."""
    if kernel == "tpu":
        return PallasOptions(kernel="tpu", blocks=PallasBlockSizes(block_rows=16, block_vocab=128))
    return PallasOptions(kernel="gpu", blocks=PallasBlockSizes(block_vocab=128))


# The kernels see only the temperature and the per-token gradient coefficient (loss type, level
# and beta reach them as that coefficient), and the level picks their path (token level: the
# TPU's one-pass kernel; sequence level: two kernels). So the grid is a covering design: every
# pair of levels of (kernel and level together, dtype, loss type, beta, temperature) once
# (tests.helpers.pairwise), which runs each kernel's every path in both dtypes and at both
# temperatures, with every loss type and both betas; test_impls.py runs the whole grid on xla.
# delta only changes the per-token coefficient the kernels are handed, so the grid here leaves
# it off (test_impls.py and gradcheck run it).
GRID = [(kernel, GRPOLossConfig(loss_type=lt, importance_sampling_level=level, beta=beta,
                                temperature=temp, max_completion_length=7), dtype)
        for (kernel, level), dtype, lt, beta, temp in pairwise(
            [(k, lvl) for k in KERNELS for lvl in ("token", "sequence")],
            (jnp.float32, jnp.bfloat16), CLASSIC_LOSS_TYPES, (0.0, 0.04), (1.0, 0.7))]


@pytest.mark.parametrize(
    "kernel,cfg,dtype",
    [pytest.param(k, c, d, id=f"{k}-{grid_id(c)}-{dtype_id(d)}")
     for k, c, d in GRID])
def test_grid_matches_reference(kernel, cfg, dtype):
    inp = random_inputs(21, 3, 7, VOCAB, dtype, cfg)  # 21 rows: 16 in full blocks + leftovers
    assert_matches_reference("pallas", inp, cfg, options=small_blocks(kernel, dtype))


OPTIONS = option_grid(7)


# Each option once, the kernel and the dtype alternating (each kernel meets both dtypes and
# both sampler settings).
OPTION_RUNS = [(KERNELS[i % 2], i) for i in range(len(OPTIONS))]


@pytest.mark.parametrize("kernel,index", OPTION_RUNS,
                         ids=[f"{k}-{option_id(OPTIONS[i])}" for k, i in OPTION_RUNS])
def test_options_match_reference(kernel, index):
    """tunix's options and sampler weights through the kernels, dtypes alternating."""
    cfg, sampler = OPTIONS[index]
    dtype = (jnp.float32, jnp.bfloat16)[index // 2 % 2]  # both dtypes meet both samplers
    inp = random_inputs(22, 3, 7, VOCAB, dtype, cfg, noise=0.3, sampler_weights=sampler)
    assert_matches_reference("pallas", inp, cfg, options=small_blocks(kernel, dtype))


# The kernels see the family's options only as per-row factors: the entropy variants (the one
# new term inside the kernels) run through them; test_impls.py runs every variant on xla.
FAMILY = [c for c in family_grid(7) if c.entropy_coef != 0]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("index", range(len(FAMILY)), ids=[family_id(c) for c in FAMILY])
def test_family_matches_reference(kernel, index):
    """The 2026 family through each kernel, dtypes alternating."""
    cfg = FAMILY[index]
    dtype = (jnp.float32, jnp.bfloat16)[index // 2 % 2]  # both dtypes meet both levels
    inp = random_inputs(23, 3, 7, VOCAB, dtype, cfg, noise=0.3)
    assert_matches_reference("pallas", inp, cfg, options=small_blocks(kernel, dtype))


LEVELS = ((1, 3, 8), (1, 7, 130), (17, 1000, 4096 + 5))
# A Latin square over B x T x V: 9 shapes per kernel in which every pair of two factors' levels
# occurs once (the full 27 took 400 s of the suite for no path these miss). The GPU kernel runs
# one row per program, so at the large vocabulary it takes the shape with one batch row.
SHAPES = [tuple(LEVELS[k][i] for k, i in enumerate((a, b, (-a - b) % 3)))
          for a in range(3) for b in range(3)]
ODD = [(k, *s) for k in KERNELS for s in SHAPES if k == "tpu" or s[2] <= 1000] + [
    ("gpu", 1, 130, 4096 + 5)]


@pytest.mark.parametrize(
    "kernel,b,t,v", [pytest.param(*s, marks=pytest.mark.slow) if s[3] > 1000 else s
                     for s in ODD])
def test_odd_shapes_match_reference(kernel, b, t, v):
    dtype = jnp.bfloat16 if (b + t) % 2 else jnp.float32
    cfg = GRPOLossConfig(loss_type="dr_grpo", importance_sampling_level="sequence", beta=0.04,
                         temperature=0.7, max_completion_length=t)
    inp = random_inputs(b * 1000 + t, b, t, v, dtype, cfg)
    opts = small_blocks(kernel, dtype)
    if v > 1000:  # larger tiles at the large vocabulary: 4 (GPU) or 8 (TPU) and a ragged one
        opts = PallasOptions(kernel=kernel, blocks=PallasBlockSizes(
            block_vocab=1024 if kernel == "gpu" else 512,
            block_rows=None if kernel == "gpu" else 64))
    assert_matches_reference("pallas", inp, cfg, options=opts)


def test_default_blocks_and_auto_kernel():
    cfg = GRPOLossConfig(beta=0.04)
    inp = random_inputs(5, 2, 9, 333, jnp.bfloat16, cfg)
    assert PallasOptions().resolved_kernel("cpu") == "tpu"
    assert PallasOptions().resolved_kernel("gpu") == "gpu"
    assert PallasOptions().resolved_interpret("cpu") and not PallasOptions().resolved_interpret("tpu")
    assert_matches_reference("pallas", inp, cfg)


def test_tpu_interpret_mode_raises_on_out_of_bounds_reads():
    """The interpret mode the kernel tests run in does catch a read past a buffer (so the
    passing tests above show the kernels' in-kernel tile reads stay inside their blocks)."""
    from jax.experimental.pallas import tpu as pltpu

    x = jnp.ones((16, 256), jnp.float32)

    def read_past_the_block(x_ref, o_ref):
        start = pl.program_id(0) * 0 + 200  # a tile that runs 72 columns past the block
        o_ref[...] = x_ref[:, pl.ds(start, 128)]

    call = pl.pallas_call(
        read_past_the_block, grid=(2,), out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
        in_specs=[pl.BlockSpec((8, 256), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
        interpret=pallas_tpu._interpret_arg(True))
    try:
        with pytest.raises(Exception, match="[Oo]ut-of-bounds"):
            jax.block_until_ready(call(x))
    finally:
        pltpu.reset_tpu_interpret_mode_state()


@pytest.mark.parametrize("kernel", KERNELS)
def test_dlogits_into_the_donated_logits_buffer(kernel):
    cfg = GRPOLossConfig(loss_type="bnpo")
    inp = random_inputs(8, 4, 8, 300, jnp.bfloat16, cfg)  # 32 rows: two full blocks of 16
    _, _, want = reference_value_and_grad(inp, cfg)
    opts = PallasOptions(kernel=kernel, alias_logits=True, blocks=PallasBlockSizes(
        block_rows=16 if kernel == "tpu" else None, block_vocab=128))

    def fn(z):
        return grpo_loss(z, inp.ids, inp.mask, inp.advantages, config=cfg, impl="pallas",
                         options=opts, **inp.kwargs())[0]

    step = jax.jit(jax.value_and_grad(fn), donate_argnums=0)
    _, got = step(inp.logits + 0)
    assert got.dtype == jnp.bfloat16 and rel_err(got, want) <= 1e-2


def test_block_rows_fit_the_row_count():
    """Given N, the planned rows drop (by at most half) to a tile multiple that divides N:
    Qwen's vocabulary over tp=4 and tp=8 in bf16, 8192 rows. With no such divisor, or rows
    that already divide N, the plan is the budget's."""
    def rows(vocab, n, dtype=jnp.bfloat16):
        return pallas_tpu.plan_blocks(vocab, dtype, "v6e", n=n).block_rows

    assert (rows(37_984, None), rows(37_984, 8192), rows(37_984, 8190)) == (80, 64, 80)
    assert (rows(18_992, None), rows(18_992, 8192)) == (160, 128)
    assert rows(151_643, 2048) == rows(151_643, None) == 16
    assert rows(151_643, 2047, jnp.float32) == 8  # no multiple of 8 in [4, 8] divides 2047
    assert pallas_tpu.plan_blocks(37_984, jnp.bfloat16, "v6e", 80, n=8192).block_rows == 80


def test_block_plan_heuristic():
    bf16 = pallas_tpu.plan_blocks(151_643, jnp.bfloat16, "v6e")
    f32 = pallas_tpu.plan_blocks(151_643, jnp.float32, "v6e")
    assert bf16.block_rows % 16 == 0 and f32.block_rows % 8 == 0
    for blocks, item in ((bf16, 2), (f32, 4)):  # the backward's 4 buffers fit the limit
        assert 4 * blocks.block_rows * 151_643 * item < blocks.vmem_limit_bytes
        assert blocks.block_vocab % 128 == 0
    small = pallas_tpu.plan_blocks(1000, jnp.float32, "v5e")
    assert small.block_rows == 512 and small.block_vocab == 1024
    assert pallas_tpu.plan_blocks(1000, jnp.float32, "v5e", 8, 256).block_rows == 8


@pytest.mark.parametrize("vocab", [151_643, 151_936])
@pytest.mark.parametrize("gen", GENERATIONS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_block_plan_fits_every_generations_vmem(gen, dtype, vocab):
    """The blocks and the scoped limit fit the chip's VMEM (benchmarks/tpu_compile.py compiles
    them); v4's 16 MiB takes 8-row blocks, single-buffered in float32."""
    plan = pallas_tpu.plan_blocks(vocab, dtype, gen)
    blocks = 2 * plan.buffers * plan.block_rows * vocab * jnp.dtype(dtype).itemsize
    assert blocks + (2 << 20) <= plan.vmem_limit_bytes <= VMEM_BYTES[gen]
    assert plan.block_rows % 8 == 0 and plan.buffers in (1, 2)
    if gen == "v4":
        assert (plan.block_rows, plan.buffers) == ((8, 2) if dtype == jnp.bfloat16 else (8, 1))
    else:  # as before VMEM was per generation: 16 / 8 rows, double-buffered, 48 MiB
        want = 16 if dtype == jnp.bfloat16 else 8
        assert (plan.block_rows, plan.buffers, plan.vmem_limit_bytes) == (want, 2, 48 << 20)


def test_block_plan_names_rows_that_fit_no_vmem():
    assert pallas_tpu.plan_blocks(151_643, jnp.bfloat16, "v4", 16).buffers == 1
    # Given rows stay double-buffered wherever the chip holds them (the limit rises to fit).
    big = pallas_tpu.plan_blocks(151_643, jnp.bfloat16, "v5p", 32)
    assert (big.buffers, big.vmem_limit_bytes) == (2, 48 << 20)
    with pytest.raises(ValueError, match=r"TPU v4: 16 rows of V=151643 float32.*impl='xla'"):
        pallas_tpu.plan_blocks(151_643, jnp.float32, "v4", 16)
    with pytest.raises(ValueError, match=r"more than the chip's 16 MiB"):
        pallas_tpu.plan_blocks(1_000_000, jnp.float32, "v4")


def test_single_buffered_blocks_give_the_same_numbers():
    """``TpuBlocks.buffers=1`` (``pl.Buffered(1)``, v4 in float32) changes the pipeline, not
    the results: the three kernels agree bit for bit with the double-buffered ones."""
    n, v = 40, 1000
    k = jax.random.split(jax.random.key(7), 3)
    z = jax.random.normal(k[0], (n, v), jnp.float32) * 3
    ids = jax.random.randint(k[1], (n,), 0, v)
    lse, coef = jax.random.normal(k[2], (2, n))
    cols = {"advantages": coef}

    def row_grad(logp, c):
        return RowGrad(g=c["advantages"] * jnp.exp(logp), h=None)

    outs = []
    for buffers in (2, 1):
        blocks = pallas_tpu.TpuBlocks(16, 256, 32 << 20, buffers)
        outs.append((pallas_tpu.row_statistics(z, ids, 1.3, blocks, interpret=True),
                     pallas_tpu.logits_gradient(z, ids, lse, coef, 1.3, blocks, interpret=True),
                     pallas_tpu.one_pass(z, ids, cols, row_grad, 1.3, blocks, interpret=True)))
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        assert bool(jnp.all(jnp.isfinite(a))) and bool(jnp.array_equal(a, b))


@pytest.mark.parametrize("bad,match", [
    (dict(kernel="cuda"), "PallasOptions.kernel"),
    (dict(interpret="yes"), "PallasOptions.interpret"),
    (dict(alias_logits=1), "PallasOptions.alias_logits"),
    (dict(blocks=(16, 128)), "PallasOptions.blocks must be None or a PallasBlockSizes"),
])
def test_bad_options(bad, match):
    with pytest.raises(ValueError, match=match):
        PallasOptions(**bad)


# Every rule holds whatever the kernel: a tiling valid on one chip is valid on the other.
@pytest.mark.parametrize("bad,match", [
    (dict(block_rows=0), "block_rows must be None or an int >= 1"),
    (dict(block_rows=8), "block_rows must be a multiple of 16"),
    (dict(block_vocab=100), "block_vocab must be a multiple of 128"),
    (dict(block_vocab=384), "block_vocab must be a power of two"),
    (dict(block_vocab=True), "block_vocab must be None or an int"),
])
def test_bad_block_sizes(bad, match):
    with pytest.raises(ValueError, match="PallasBlockSizes." + match):
        PallasBlockSizes(**bad)


def test_options_must_fit_the_impl():
    cfg = GRPOLossConfig()
    inp = random_inputs(1, 1, 4, 50, jnp.bfloat16, cfg)
    with pytest.raises(ValueError, match="PallasOptions for impl='pallas'"):
        grpo_loss(inp.logits, inp.ids, inp.mask, inp.advantages, config=cfg, impl="xla",
                  options=PallasOptions())


def _export_value_and_grad(b, t, v, dtype, platform, kernel, level="token", softcap=None,
                           **options):
    cfg = GRPOLossConfig(beta=0.04, importance_sampling_level=level)
    spec = jax.ShapeDtypeStruct
    args = (spec((b, t, v), dtype), spec((b, t), jnp.int32), spec((b, t), jnp.float32),
            spec((b,), jnp.float32), spec((b, t), jnp.float32), spec((b, t), jnp.float32))

    def f(z, ids, mask, adv, old, ref):
        return grpo_loss(z, ids, mask, adv, config=cfg, impl="pallas", old_logps=old,
                         ref_logps=ref, logit_softcap=softcap,
                         options=PallasOptions(kernel=kernel, interpret=False, **options))

    step = jax.jit(jax.value_and_grad(f, has_aux=True))
    if platform == "cuda":
        return cuda_export(step, *args)
    with every_platform():
        return jax.export.export(step, platforms=[platform])(*args)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("b,level,cap", [(1, "token", None), (4, "token", None),
                                         (8, "token", 30.0), (1, "sequence", 30.0)])
def test_tpu_kernels_lower_at_the_real_shapes(b, level, cap, dtype):
    """value_and_grad at B x 2048 x 151,643 lowers for TPU: to the one-pass Mosaic kernel at
    token level, to the statistics and gradient kernels at sequence level; with a soft cap
    too (its tanh inside the kernels)."""
    exported = _export_value_and_grad(b, 2048, 151_643, dtype, "tpu", "tpu", level, cap)
    text = exported.mlir_module()
    if level == "token":
        assert text.count("tpu_custom_call") == 1 and "grpo_one_pass" in text
    else:
        assert text.count("tpu_custom_call") == 2 and "grpo_one_pass" not in text
    grad = exported.out_avals[-1]
    assert grad.shape == (b, 2048, 151_643) and grad.dtype == dtype


@pytest.mark.parametrize("b,t", [(1, 2048), (4, 1024)])
def test_gpu_kernels_lower_for_cuda(b, t):
    """The rows layout's Triton kernels lower at the GPU benchmark shapes (the CPU jaxlib emits
    Triton IR): each kernel as a call over the full 8192-column tiles and one over the ragged
    tail (151,643 = 18 x 8192 + 4187). The default there, the aligned layout, has its own test
    (test_pallas_gpu_aligned.py)."""
    try:
        exported = _export_value_and_grad(b, t, 151_643, jnp.bfloat16, "cuda", "gpu",
                                          gpu_layout="rows")
    except ValueError as e:
        if "install jaxlib GPU" in str(e):
            pytest.skip("this jaxlib cannot lower Pallas GPU (Triton) kernels without the CUDA "
                        "plugin; the GPU kernel is covered by interpret-mode tests here and by "
                        "the GPU runs in docs/benchmarks.md when a GPU is available")
        raise
    text = exported.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 4
    assert text.count("grpo_tile_statistics") >= 2 and text.count("grpo_tile_gradient") >= 2


def test_gpu_gradient_kernel_traces_exp_before_the_row_scalars():
    """The GPU gradient kernel's jaxpr (= its Triton IR order) computes ``exp`` before it reads
    the row's coefficient and id. With those reads first the kernel ran 1.45-1.65x as long on
    an H100 at V = 151,643 (docs/benchmarks.md, "GPU"); nothing else in the IR differed."""
    from grpo_kernels.ops.logits_loss import pallas_gpu

    n, v = 2, 8192 + 7
    z, ids = jnp.zeros((n, v), jnp.bfloat16), jnp.zeros((n,), jnp.int32)
    row = jnp.zeros((n,), jnp.float32)
    outer = jax.make_jaxpr(lambda z: pallas_gpu.logits_gradient(
        z, ids, row, row, 1.0, pallas_gpu.plan_blocks(v), interpret=True))(z)
    kernels = [e.params["jaxpr"] for e in outer.jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert len(kernels) == 2  # the full tiles and the ragged tail
    for kernel in kernels:
        names = [e.primitive.name for e in kernel.eqns]
        exp = names.index("exp")
        # reads: logits tile, lse (before exp: exp needs it), then coef and id after exp
        reads = [i for i, nm in enumerate(names) if nm in ("get", "load", "masked_load")]
        assert len(reads) == 4, names
        assert reads[1] < exp < reads[2] < reads[3], names


# The one-pass TPU kernel (token-separable configs; the grids above run it wherever the TPU
# kernel meets a token-level config): odd shapes, each of a row block that holds the whole
# batch and one with leftover rows (16-row blocks) meeting each of a vocabulary under one
# tile and a ragged last tile (128 columns), in both dtypes.
ONE_PASS_SHAPES = [(1, 1, 17), (8, 1, 1000), (3, 7, 1000), (8, 7, 17)]


@pytest.mark.parametrize("b,t,v", ONE_PASS_SHAPES)
def test_one_pass_odd_shapes_match_reference(b, t, v):
    dtype = jnp.bfloat16 if (b + t) % 2 else jnp.float32
    cfg = GRPOLossConfig(loss_type="dapo", beta=0.04, delta=2.0, temperature=0.7,
                         entropy_coef=0.02)
    inp = random_inputs(b * 100 + t, b, t, v, dtype, cfg)
    opts = dataclasses.replace(small_blocks("tpu", dtype), one_pass=True)
    assert_matches_reference("pallas", inp, cfg, options=opts)


TPU_KERNELS = ("grpo_one_pass", "grpo_row_statistics", "grpo_logits_gradient")


def kernel_names(cfg, options, names=TPU_KERNELS, grad=True):
    """Which of the kernels ``names`` the loss (with ``grad``, its value_and_grad) calls."""
    inp = random_inputs(0, 2, 9, 300, jnp.float32, cfg)
    f = lambda z: grpo_loss(z, inp.ids, inp.mask, inp.advantages, config=cfg, impl="pallas",
                            options=options, **inp.kwargs())[0]
    text = str(jax.make_jaxpr(jax.value_and_grad(f) if grad else f)(inp.logits))
    return {n for n in names if n in text}


def test_one_pass_is_the_tpu_default_for_token_separable_configs():
    tpu = PallasOptions(kernel="tpu")
    assert kernel_names(GRPOLossConfig(), tpu) == {"grpo_one_pass"}
    two = {"grpo_row_statistics", "grpo_logits_gradient"}
    assert kernel_names(GRPOLossConfig(importance_sampling_level="sequence"), tpu) == two
    assert kernel_names(GRPOLossConfig(top_entropy_quantile=0.5, entropy_coef=0.1), tpu) == two
    assert kernel_names(GRPOLossConfig(), dataclasses.replace(tpu, one_pass=False)) == two
    # the two kernels on a token-level config still match the reference
    cfg = GRPOLossConfig(loss_type="bnpo", beta=0.04)
    inp = random_inputs(9, 3, 7, 300, jnp.float32, cfg)
    assert_matches_reference("pallas", inp, cfg, options=dataclasses.replace(
        small_blocks("tpu", jnp.float32), one_pass=False))


@pytest.mark.parametrize("options,cfg", [
    (PallasOptions(kernel="gpu", one_pass=True), GRPOLossConfig(loss_type="vespo")),
    (PallasOptions(kernel="tpu", one_pass=True), GRPOLossConfig(loss_type="vespo")),
    (PallasOptions(kernel="tpu", one_pass=True),
     GRPOLossConfig(importance_sampling_level="sequence")),
], ids=["gpu", "vespo", "sequence"])
def test_one_pass_refuses_what_it_cannot_run(options, cfg):
    inp = random_inputs(1, 1, 4, 50, jnp.float32, cfg)
    with pytest.raises(ValueError, match="PallasOptions.one_pass=True needs a token-separable"):
        grpo_loss(inp.logits, inp.ids, inp.mask, inp.advantages, config=cfg, impl="pallas",
                  options=options, **inp.kwargs())


def test_one_pass_flag_is_checked():
    with pytest.raises(ValueError, match="PallasOptions.one_pass must be None, True or False"):
        PallasOptions(one_pass="yes")
