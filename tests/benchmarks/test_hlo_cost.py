"""benchmarks/hlo_cost.py: a compiled program's flops and bytes with its loops counted as often
as they run, against XLA's own cost analysis (which counts a loop's body once)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import hlo_cost  # noqa: E402

N, ROWS, H, V = 5, 24, 32, 96


def _scan(w, x):
    """N chunks of ``ROWS`` rows through a matmul and a reduction: ``N * 2 ROWS H V`` flops."""
    def body(carry, xs):
        return carry + jnp.sum(jnp.tanh(xs @ w)), None
    return jax.lax.scan(body, jnp.float32(0), x.reshape(N, ROWS, H))[0]


def _compiled(fn, *shapes):
    return jax.jit(fn).lower(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)).compile()


def _xla(compiled) -> dict:
    c = compiled.cost_analysis()
    return c[0] if isinstance(c, (list, tuple)) else c


@pytest.mark.default_emitters
def test_a_scans_body_counts_once_per_trip():
    compiled = _compiled(_scan, (H, V), (N * ROWS, H))
    text = compiled.as_text()
    once, counted = hlo_cost.loop_costs(text, trips=False), hlo_cost.loop_costs(text)
    body_flops = 2 * ROWS * H * V
    assert once.flops == body_flops and counted.flops == N * body_flops
    assert counted.unknown_loops == []
    # XLA's own count is the body once: the matmul's flops (plus its element-wise ones)
    assert body_flops <= _xla(compiled)["flops"] < 1.1 * body_flops
    # every chunk reads W again
    assert counted.bytes_accessed >= N * 4 * H * V > once.bytes_accessed


@pytest.mark.default_emitters
def test_a_program_without_loops_agrees_with_xla():
    compiled = _compiled(lambda w, x: jnp.sum(jnp.tanh(x @ w), axis=0), (H, V), (ROWS, H))
    mine, xla = hlo_cost.loop_costs(compiled.as_text()), _xla(compiled)
    assert mine.flops == 2 * ROWS * H * V
    assert mine.flops == pytest.approx(xla["flops"], rel=0.05)
    assert mine.bytes_accessed == pytest.approx(xla["bytes accessed"], rel=0.35)


def test_the_condition_bound_gives_the_trip_count_where_xla_wrote_none():
    text = """HloModule m

%cond (p: (s32[], f32[])) -> pred[] {
  %p = (s32[], f32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p.1: (s32[], f32[])) -> (s32[], f32[]) {
  %p.1 = (s32[], f32[]) parameter(0)
  %a = f32[8,16]{1,0} parameter(1)
  %b = f32[16,4]{1,0} parameter(2)
  %d = f32[8,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[]) tuple(%i.1, %s)
}

ENTRY %main (x: (s32[], f32[])) -> (s32[], f32[]) {
  %x = (s32[], f32[]) parameter(0)
  ROOT %w = (s32[], f32[]) while(%x), condition=%cond, body=%body
}
"""
    assert hlo_cost.loop_costs(text).flops == 7 * 2 * 8 * 16 * 4
    unknown = text.replace("constant(7)", "parameter(1)")
    costs = hlo_cost.loop_costs(unknown)
    assert costs.flops == 2 * 8 * 16 * 4 and costs.unknown_loops == ["w"]


@pytest.mark.default_emitters
def test_in_place_updates_and_slices_count_what_they_touch():
    def fn(buf, x):
        part = jax.lax.dynamic_slice_in_dim(buf, 8, 4, axis=0) * 2.0
        return jax.lax.dynamic_update_slice_in_dim(buf, part + x, 16, axis=0)
    compiled = jax.jit(fn, donate_argnums=0).lower(
        jax.ShapeDtypeStruct((1024, 64), jnp.float32),
        jax.ShapeDtypeStruct((4, 64), jnp.float32)).compile()
    mine = hlo_cost.loop_costs(compiled.as_text())
    assert mine.bytes_accessed < 1024 * 64 * 4  # a few rows, not the buffer
