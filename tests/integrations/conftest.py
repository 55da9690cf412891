"""tunix's own code is not written for this suite's strict promotion rules (tests/conftest.py):
its losses mix bool and int32 arrays. The integration tests run it under JAX's standard rules;
our code runs under them here too, and under the strict ones everywhere else."""

import jax
import pytest


@pytest.fixture(scope="package", autouse=True)
def _standard_promotion():
    saved = (jax.config.jax_numpy_dtype_promotion, jax.config.jax_numpy_rank_promotion)
    jax.config.update("jax_numpy_dtype_promotion", "standard")
    jax.config.update("jax_numpy_rank_promotion", "allow")
    yield
    jax.config.update("jax_numpy_dtype_promotion", saved[0])
    jax.config.update("jax_numpy_rank_promotion", saved[1])
