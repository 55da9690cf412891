"""Strict JAX settings for every test (after equinox's tests/conftest.py), and a faster compiler.

The tests' shapes are tiny, so compiling, not running, is most of the suite's time. LLVM's
backend optimisation level 0 compiles the same HLO about 35% faster here and leaves alone what
the tests read: the float operations and their order (XLA's HLO fixes them; the level changes at
most whether a multiply and an add fuse, one rounding) and the HLO passes (fusion, buffer
assignment) behind the memory and lowering tests. It must be in XLA_FLAGS before a JAX backend
starts; subprocesses the tests spawn inherit it. A level the caller set wins.
"""

import os

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture(autouse=True)
def _no_implicit_rank_promotion():
    yield


def pytest_addoption(parser):
    parser.addoption("--tunix-grid", choices=("auto", "full", "pairwise"), default="auto",
                     help="tests/integrations/test_tunix.py's parity grid: every combination "
                     "(full), every pair (pairwise), or auto: full against tunix 0.1.7, "
                     "pairwise against its development head")
