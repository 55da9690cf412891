"""ops.core.platform.by_platform: the branch of the platform a program is lowered for."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_kernels.ops.core.platform import ENV, by_platform, staged_kinds
from tests.helpers import every_platform

SCALE = {"cpu": 2.0, "gpu": 3.0, "tpu": 5.0}


def _constants(text: str) -> set[float]:
    """The float constants of a lowered program."""
    return {float(x) for x in re.findall(r"dense<([0-9.]+e[+-][0-9]+)> : tensor<f32>", text)}


@every_platform()
def test_each_platform_lowers_its_own_branch_and_equal_plans_trace_once():
    traced = []

    def fn(p, x):
        traced.append(p)
        return x * p

    x = jax.random.normal(jax.random.PRNGKey(0), (4,))
    f = jax.jit(lambda x: by_platform(fn, SCALE.__getitem__, x))
    for platform, kind in (("cpu", "cpu"), ("cuda", "gpu"), ("rocm", "gpu"), ("tpu", "tpu")):
        text = f.trace(x).lower(lowering_platforms=(platform,)).as_text()
        assert SCALE[kind] in _constants(text)
        assert not (set(SCALE.values()) - {SCALE[kind]}) & _constants(text), platform
    assert sorted(set(traced)) == [2.0, 3.0, 5.0]
    # Outside jit only the host's branch runs; under jit the host's result is the same.
    np.testing.assert_allclose(np.asarray(by_platform(fn, SCALE.__getitem__, x)),
                               np.asarray(x) * SCALE["cpu"])
    np.testing.assert_allclose(np.asarray(f(x)), np.asarray(x) * SCALE["cpu"])
    traced.clear()
    jax.jit(lambda x: by_platform(fn, lambda kind: 1.0 if kind == "cpu" else 4.0, x)).trace(x)
    assert sorted(traced) == [1.0, 4.0]  # gpu and tpu share the accelerator branch


def test_pytree_operands_and_outputs():
    def fn(on_cpu, tree):
        a, (b, c) = tree
        return {"sum": a + b, "c": c if on_cpu else -c, "none": None}

    tree = (jnp.ones(3), (jnp.arange(3.0), jnp.full((2,), 7.0)))
    out = jax.jit(lambda t: by_platform(fn, lambda kind: kind == "cpu", t))(tree)
    assert out["none"] is None
    np.testing.assert_allclose(np.asarray(out["c"]), [7.0, 7.0])


def test_the_environment_names_the_kinds_traced(monkeypatch):
    """``GRPO_KERNELS_PLATFORMS=cpu``: the CPU's branch alone is traced, the CPU program is
    the same, and a lowering for another platform fails naming it; ``gpu,tpu``: the accelerator
    branch serves every platform but the CPU. A kind not among cpu, gpu, tpu is refused with
    the variable's name."""
    traced = []

    def fn(p, x):
        traced.append(p)
        return x * p

    x = jax.random.normal(jax.random.PRNGKey(1), (4,))
    monkeypatch.setenv(ENV, "cpu")
    f = jax.jit(lambda x: by_platform(fn, SCALE.__getitem__, x))
    text = f.trace(x).lower(lowering_platforms=("cpu",)).as_text()
    assert traced == [SCALE["cpu"]] and _constants(text) == {SCALE["cpu"]}
    np.testing.assert_allclose(np.asarray(f(x)), np.asarray(x) * SCALE["cpu"])
    with pytest.raises(NotImplementedError, match="platform tpu"):
        f.trace(x).lower(lowering_platforms=("tpu",))

    traced.clear()
    monkeypatch.setenv(ENV, " gpu, tpu,gpu ")
    assert staged_kinds() == ("gpu", "tpu")
    g = jax.jit(lambda x: by_platform(fn, lambda kind: 1.0 if kind == "cpu" else 4.0, x))
    assert 4.0 in _constants(g.trace(x).lower(lowering_platforms=("rocm",)).as_text())
    assert traced == [4.0]

    monkeypatch.setenv(ENV, "cpu,npu")
    with pytest.raises(ValueError, match=f"{ENV}='cpu,npu': \\['npu'\\] not among"):
        staged_kinds()
    monkeypatch.setenv(ENV, "")
    assert staged_kinds() == ("cpu", "gpu", "tpu")
