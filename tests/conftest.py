"""Strict JAX settings for every test (after equinox's tests/conftest.py)."""

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture(autouse=True)
def _no_implicit_rank_promotion():
    yield
