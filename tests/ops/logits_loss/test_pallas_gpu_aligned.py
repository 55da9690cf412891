"""The GPU kernels' ``"aligned"`` layout (``pallas_gpu_aligned``), interpreted: against the
reference, against the ``"rows"`` layout kernel by kernel, and lowered for CUDA.

The layout's own arithmetic is per row: a head of ``h_r = (-r V) mod a`` elements (``a`` = 8 for
bf16, 4 for f32), ``F = (V - a + 1) // block_vocab`` full tiles, then a tail. The shapes below
give every head length (rows >= ``a`` with ``V`` odd), no full tile, one tile exactly at the
bound ``V = block_vocab + a - 1`` and rows two short of it, and a row shorter than the
vector width (a head longer than the row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_kernels import GRPOLossConfig, PallasBlockSizes, PallasOptions, grpo_loss
from grpo_kernels.ops.logits_loss import pallas_gpu
from grpo_kernels.ops.logits_loss import pallas_gpu_aligned as aligned
from grpo_kernels.ops.logits_loss.inputs import random_inputs
from tests.helpers import cuda_module, reference_value_and_grad, rel_err
from tests.ops.logits_loss.test_impls import assert_matches_reference
from tests.ops.logits_loss.test_pallas import kernel_names


def _options(block_vocab: int = 128, **kw) -> PallasOptions:
    return PallasOptions(kernel="gpu", gpu_layout="aligned",
                         blocks=PallasBlockSizes(block_vocab=block_vocab), **kw)


# (B, T, V, dtype): bf16 rows are 8-aligned, f32 rows 4-aligned.
SHAPES = [
    (3, 7, 1000, jnp.bfloat16),  # 21 rows: every head length, 7 full tiles and a tail
    (2, 5, 135, jnp.bfloat16),   # V = 128 + 7: one full tile for every head
    (2, 5, 133, jnp.bfloat16),   # two short: no full tile (heads of 6, 7 leave < 128)
    (1, 9, 131, jnp.float32),    # V = 128 + 3: one full tile at f32's bound
    (3, 3, 129, jnp.float32),    # two short at f32 (heads of 2, 3 leave < 128)
    (4, 3, 5, jnp.bfloat16),     # V < 8: heads longer than the row
    (3, 1, 256, jnp.float32),    # aligned rows (head 0), two full tiles (F = (256-3)//128 = 1)
]
CONFIGS = [
    GRPOLossConfig(),
    GRPOLossConfig(beta=0.04, temperature=0.7, loss_type="bnpo"),
    GRPOLossConfig(entropy_coef=0.01, loss_type="dapo"),  # the tiles' entropy term
    GRPOLossConfig(importance_sampling_level="sequence", entropy_coef=0.02, temperature=1.3),
]


@pytest.mark.parametrize("index", range(len(SHAPES)),
                         ids=[f"{b}x{t}x{v}-{jnp.dtype(d).name}" for b, t, v, d in SHAPES])
def test_matches_reference(index):
    b, t, v, dtype = SHAPES[index]
    cfg = CONFIGS[index % len(CONFIGS)]
    inp = random_inputs(100 + index, b, t, v, dtype, cfg)
    assert_matches_reference("pallas", inp, cfg, options=_options())


def test_every_head_length_and_tile_count_occurs():
    """The shapes above do reach the cases the docstring names."""
    cases = set()
    for b, t, v, dtype in SHAPES:
        a = aligned.alignment(dtype)
        full = aligned.full_tiles(v, 128, a)
        heads = {(-r * v) % a for r in range(b * t)}
        cases |= {("full", min(full, 2))} | {("head>V", True) for h in heads if h > v}
        # a row whose head leaves less than V // 128 tiles: a count ignoring heads overruns
        cases |= {("overrun", True) for h in heads if h + (v // 128) * 128 > v}
        if a == 8 and v % 2:
            cases.add(("all heads", heads == set(range(8))))
    assert cases >= {("full", 0), ("full", 1), ("full", 2), ("head>V", True),
                     ("all heads", True), ("overrun", True)}, cases


def _kernel_inputs(seed, n, v, dtype):
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    z = (3 * jax.random.normal(k[0], (n, v), jnp.float32)).astype(dtype)
    ids = jax.random.randint(k[1], (n,), 0, v, dtype=jnp.int32)
    ids = ids.at[::3].set(-1)  # what a vocab-sharded caller passes for ids another shard owns
    coef, hcoef = (jax.random.normal(k[i], (n,), jnp.float32) for i in (2, 3))
    return z, ids, coef, hcoef


@pytest.mark.parametrize("alias", [False, True], ids=["fresh", "alias_logits"])
@pytest.mark.parametrize("with_entropy", [False, True], ids=["plain", "entropy"])
def test_gradient_equals_the_rows_layout(alias, with_entropy):
    """Kernel by kernel, float32, ids of -1 included (no column is chosen): the aligned
    gradient equals the rows layout's to float32 rounding (exp2 against exp)."""
    n, v, tau = 11, 300, 0.8
    z, ids, coef, hcoef = _kernel_inputs(3, n, v, jnp.float32)
    rows, al = (pallas_gpu.plan_blocks(v, 128, layout) for layout in pallas_gpu.LAYOUTS)
    logp, lse, ent = pallas_gpu.row_statistics(z, jnp.maximum(ids, 0), tau, rows, True)
    got_stats = pallas_gpu.row_statistics(z, jnp.maximum(ids, 0), tau, al, True)
    for a, b in zip(got_stats, (logp, lse, ent)):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6)
    extra = dict(hcoef=hcoef, entropy=ent) if with_entropy else {}
    want = pallas_gpu.logits_gradient(z, ids, lse, coef, tau, rows, True, **extra)
    got = jax.jit(lambda z: pallas_gpu.logits_gradient(
        z, ids, lse, coef, tau, al, True, alias_logits=alias, **extra),
        donate_argnums=0 if alias else ())(z + 0)
    assert float(jnp.max(jnp.abs(got - want))) <= 1e-6 * float(jnp.max(jnp.abs(want)))
    if not with_entropy:  # rows with no chosen column: -c p, the sign of -c everywhere
        assert bool(jnp.all(got[::3] * coef[::3, None] <= 0))


def test_masked_vocabulary_and_nan():
    """-inf logits (in heads, tiles and tails) contribute nothing; a NaN logit makes its row's
    statistics NaN (Triton's max ignores NaN, so S must carry it)."""
    n, v = 9, 300
    z, ids, _, _ = _kernel_inputs(4, n, v, jnp.bfloat16)
    ids = jnp.maximum(ids, 0)
    cols = jnp.arange(v)[None, :]
    z = jnp.where((cols % 3 == 0) & (cols != ids[:, None]), -jnp.inf, z)
    z = z.at[5].set(-jnp.inf)  # a row with nothing left
    al = pallas_gpu.plan_blocks(v, 128, "aligned")
    rows = pallas_gpu.plan_blocks(v, 128, "rows")
    got = pallas_gpu.row_statistics(z, ids, 1.0, al, True)
    want = pallas_gpu.row_statistics(z, ids, 1.0, rows, True)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6)  # equal_nan: the empty row
    assert float(got[1][5]) == -np.inf
    bad = z.at[2, 150].set(jnp.nan)
    stats = pallas_gpu.row_statistics(bad, ids, 1.0, al, True)
    assert all(np.isnan(float(s[2])) for s in stats[1:])
    assert not np.isnan(np.asarray(stats[1])[np.arange(n) != 2]).all()


def test_dlogits_into_the_donated_logits_buffer():
    cfg = GRPOLossConfig(loss_type="bnpo", entropy_coef=0.05)
    inp = random_inputs(8, 4, 8, 300, jnp.bfloat16, cfg)
    _, _, want = reference_value_and_grad(inp, cfg)
    opts = _options(alias_logits=True)

    def fn(z):
        return grpo_loss(z, inp.ids, inp.mask, inp.advantages, config=cfg, impl="pallas",
                         options=opts, **inp.kwargs())[0]

    _, got = jax.jit(jax.value_and_grad(fn), donate_argnums=0)(inp.logits + 0)
    assert got.dtype == jnp.bfloat16 and rel_err(got, want) <= 1e-2


def test_int32_offsets_are_checked():
    z = jax.ShapeDtypeStruct((16384, 151_643), jnp.bfloat16)  # B=8, T=2048: 2.48e9 elements
    blocks = pallas_gpu.plan_blocks(151_643, None, "aligned")
    ids = jnp.zeros((16384,), jnp.int32)
    with pytest.raises(ValueError, match=r"N \* V = 16384 \* 151643 .* must be < 2\^31"):
        jax.eval_shape(lambda z: pallas_gpu.row_statistics(z, ids, 1.0, blocks), z)


def test_layout_option_is_checked():
    with pytest.raises(ValueError, match="gpu_layout must be 'auto' or one of"):
        PallasOptions(gpu_layout="columns")
    with pytest.raises(ValueError, match="GPU layout must be 'auto' or one of"):
        pallas_gpu.plan_blocks(300, None, "columns")


def test_auto_layout_is_aligned_where_its_int32_offsets_fit():
    """The default: aligned (faster at every shape of the H100 proof) up to N * V < 2^31,
    rows beyond (B=8, T=2048 at Qwen's vocabulary), and rows when N is not known."""
    assert PallasOptions().gpu_layout == "auto"
    assert pallas_gpu.plan_blocks(151_643, None, "auto", 2048).layout == "aligned"
    assert pallas_gpu.plan_blocks(151_643, None, "auto", 16384).layout == "rows"
    limit = 2 ** 31 // 151_643  # the last N whose N * V is below 2^31
    assert pallas_gpu.plan_blocks(151_643, None, "auto", limit).layout == "aligned"
    assert pallas_gpu.plan_blocks(151_643, None, "auto", limit + 1).layout == "rows"
    assert pallas_gpu.plan_blocks(151_643, None, "auto").layout == "rows"
    assert pallas_gpu.plan_blocks(151_643, None, "rows", 2048).layout == "rows"
    # The loss hands the planner its row count: the default options run the aligned kernels.
    edge = ("grpo_edge_statistics", "grpo_edge_gradient", "grpo_tile_statistics")
    assert kernel_names(GRPOLossConfig(), PallasOptions(kernel="gpu"), edge) == set(edge[:2])


@pytest.mark.parametrize("b,t", [(1, 2048), (4, 1024)])
def test_lowers_for_cuda_at_the_benchmark_shapes(b, t):
    """value_and_grad at V = 151,643 bf16 lowers to four Triton calls: the aligned tiles and
    the edge, for each kernel."""
    cfg = GRPOLossConfig(beta=0.04)
    spec = jax.ShapeDtypeStruct
    args = (spec((b, t, 151_643), jnp.bfloat16), spec((b, t), jnp.int32),
            spec((b, t), jnp.float32), spec((b,), jnp.float32), spec((b, t), jnp.float32))

    def f(z, ids, mask, adv, ref):
        return grpo_loss(z, ids, mask, adv, config=cfg, impl="pallas", ref_logps=ref,
                         options=PallasOptions(kernel="gpu", gpu_layout="aligned",
                                               interpret=False))

    text = cuda_module(jax.value_and_grad(f, has_aux=True), *args)
    assert text.count("__gpu$xla.gpu.triton") == 4
    for name in ("grpo_aligned_statistics", "grpo_edge_statistics", "grpo_aligned_gradient",
                 "grpo_edge_gradient"):
        assert name in text
