"""tests/conftest.py's split of the suite by XLA:CPU's emitters."""

import os

import jax
import jax.numpy as jnp
import pytest

from tests import conftest


@pytest.mark.parametrize("markexpr, left_out", [
    ("not default_emitters", True), ("  not  default_emitters ", True),
    ("not default_emitters and not slow", True),
    ("", False), ("default_emitters", False), ("slow", False),
    ("not default_emitters or slow", False), ("not slow and not default_emitters", False),
    ("not default_emitters_x", False),
])
def test_only_a_run_without_the_marked_tests_leaves_the_default(markexpr, left_out):
    """The legacy emitters only where the selection can hold no marked test (a conjunction
    led by ``not default_emitters``; one the expression leads otherwise keeps the default)."""
    assert conftest.leaves_out_default_emitters(markexpr) is left_out


def test_a_plan_read_in_a_legacy_run_fails_by_name():
    """In a run on the legacy emitters, this file's read of a plan fails naming the marker;
    in a run on the default ones it is answered."""
    compiled = jax.jit(lambda x: jnp.tanh(x) * 2).lower(jnp.ones(8)).compile()
    if conftest.FAST_EMITTERS in os.environ["XLA_FLAGS"]:
        with pytest.raises(AssertionError, match="mark the test default_emitters"):
            compiled.memory_analysis()
    else:
        assert compiled.memory_analysis().output_size_in_bytes == 32
