"""ops/core/tpu.py (generations and their VMEM) and the options and casts that depend on the
platform a program is lowered for rather than the host that traces it."""

import jax
import jax.numpy as jnp
import pytest

from grpo_kernels import PallasOptions
from grpo_kernels.ops.core import tpu
from grpo_kernels.ops.core.dtypes import cast_to
from grpo_kernels.ops.lm_head_loss.pallas_options import LmHeadPallasOptions, plan_tiles
from tests.helpers import every_platform


@pytest.mark.parametrize("kind,gen", [("TPU v4", "v4"), ("TPU v5 lite", "v5e"),
                                      ("TPU v5e", "v5e"), ("TPU v5", "v5p"),
                                      ("TPU v5p", "v5p"), ("TPU v6 lite", "v6e"),
                                      ("TPU7x", "v7x"), ("cpu", None), ("NVIDIA H100", None)])
def test_generation_of_device_kind(kind, gen):
    assert tpu.generation_of_kind(kind) == gen


def test_a_cpu_host_plans_for_the_default_unless_told():
    assert tpu.tpu_generation() == tpu.DEFAULT_GENERATION == "v6e"
    assert tpu.tpu_generation("v4") == "v4"
    with pytest.raises(ValueError, match=r"^tpu_generation must be None or one of .*'v3'"):
        tpu.tpu_generation("v3")


@pytest.mark.parametrize("cls", [PallasOptions, LmHeadPallasOptions])
def test_options_name_a_bad_generation(cls):
    assert cls(tpu_generation="v5p").tpu_generation == "v5p"
    with pytest.raises(ValueError, match=f"{cls.__name__}.tpu_generation must be None or one"):
        cls(tpu_generation="trillium")


def test_lm_head_tiles_fit_v4():
    """At 512 vocabulary columns the dW kernel's blocks need 26.5 MiB at H = 4096, more than
    v4's 16 MiB (a compile for v4 fails); 128 columns and a 16 MiB limit compile."""
    v4 = plan_tiles(8192, 4096, 151_936, LmHeadPallasOptions(tpu_generation="v4"))
    v6e = plan_tiles(8192, 4096, 151_936, LmHeadPallasOptions(tpu_generation="v6e"))
    assert (v4.vocab, v4.vmem_limit_bytes) == (128, 16 << 20)
    assert (v6e.vocab, v6e.vmem_limit_bytes) == (512, 64 << 20)
    mine = LmHeadPallasOptions(tpu_generation="v4", vmem_limit_bytes=8 << 20)
    assert plan_tiles(8192, 4096, 151_936, mine).vmem_limit_bytes == 8 << 20


def test_bfloat16_cast_is_chosen_for_the_lowering_platform():
    """The integer rounding XLA:CPU needs is in the CPU program only: a TPU or CUDA program
    traced here keeps the plain convert, which the TPU compiler fuses away."""
    fn = jax.jit(lambda x: cast_to(x * 3, jnp.bfloat16))
    x = jax.random.normal(jax.random.key(0), (64, 128)) * 1e3

    def text(platform):
        with every_platform():
            return jax.export.export(fn, platforms=[platform])(x).mlir_module()

    assert "shift_right_logical" in text("cpu")
    for platform in ("tpu", "cuda"):
        assert "shift_right_logical" not in text(platform) and "convert" in text(platform)
    got = fn(x)
    assert got.dtype == jnp.bfloat16 and bool(jnp.array_equal(got, (x * 3).astype(jnp.bfloat16)))


@pytest.mark.parametrize("shape,row_major", [
    ((4096, 151_936), True), ((4096, 151_643), False), ((4096, 151_936 // 4), False),
    ((151_643, 4096), True), ((100, 151_643), True), ((4096, 151_675), True),
    ((4096, 151_668), False), ((37_984, 100), False), ((4096, 64), False), ((130, 300), True)])
def test_the_tpu_argument_layout_rule(shape, row_major):
    """Row-major unless H-minor pads less in (8, 128) tiles; a tie stays row-major
    ([4096, 151,675]: both pad to 151,680). libtpu's compiler agrees on each of these
    (tests/benchmarks/test_tpu_compile.py)."""
    assert tpu.row_major_by_default(shape) is row_major
