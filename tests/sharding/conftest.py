"""The multi-device tests need 8 devices, which on CPU must be asked for before JAX starts.

``make test`` runs this folder as its own pytest run with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``; the main run leaves it out. Run alone
without the flag, every test here is skipped and says so.
"""

import jax
import pytest

from grpo_kernels.sharding import ShardingSpec, mesh_from_shape

NEEDED = 8

# The meshes: (shape, axis names); "tp" splits V, every other axis splits B.
MESHES = [((8, 1), ("dp", "tp")), ((2, 4), ("dp", "tp")), ((1, 8), ("dp", "tp")),
          ((2, 2, 2), ("dp", "fsdp", "tp"))]


def mesh_id(m) -> str:
    return "x".join(f"{n}{s}" for s, n in zip(*m))


def make(m):
    shape, names = m
    return mesh_from_shape(shape, names), ShardingSpec(tuple(n for n in names if n != "tp"), "tp")


def pytest_collection_modifyitems(config, items):
    if jax.device_count() >= NEEDED:
        return
    skip = pytest.mark.skip(reason=f"needs {NEEDED} devices, found {jax.device_count()}: run "
                            f"XLA_FLAGS=--xla_force_host_platform_device_count={NEEDED} "
                            f"pytest tests/sharding (make test does)")
    for item in items:
        if "tests/sharding" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
