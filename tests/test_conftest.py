"""tests/conftest.py's split of the suite by XLA:CPU's emitters."""

import os

import jax
import jax.numpy as jnp
import pytest

from tests import conftest


def _program():
    """A one-operation program whose HLO differs with the emitters: the default ones wrap the
    operation in a loop fusion, the legacy ones leave it bare."""
    return jax.jit(jnp.exp).lower(jnp.ones(8))


def _fusions(compiled) -> int:
    return compiled.as_text().count(" fusion(")


def test_marked_tests_run_last_and_slow_ones_first():
    """The marked tests move behind the others (so each worker switches once), and in each
    group the slow tests come first, each keeping its order; the order of this run's tests
    shows it."""
    items = conftest.ORDER
    assert items
    marked = [i.get_closest_marker(conftest.MARK) is not None for i in items]
    assert marked == sorted(marked)
    for group in (True, False):
        slow = [i.get_closest_marker("slow") is None for i, m in zip(items, marked) if m == group]
        assert slow == sorted(slow)
    assert conftest.run_order(items) == items


def test_a_plan_read_on_the_legacy_emitters_fails_by_name():
    """While this process compiles on the legacy emitters, this file's read of a plan fails
    naming the marker (in a run whose caller chose the emitters, it is answered)."""
    compiled = _program().compile()
    if conftest._EMITTERS["switching"]:
        assert not conftest._EMITTERS["default"]
        assert conftest.FAST_EMITTERS in os.environ["XLA_FLAGS"]
        with pytest.raises(AssertionError, match="mark the test default_emitters"):
            compiled.memory_analysis()
    else:
        assert compiled.memory_analysis().output_size_in_bytes == 32


@pytest.mark.default_emitters
def test_a_marked_test_compiles_on_the_default_emitters():
    """A marked test's compile is the default emitters' program (the operation wrapped in a
    fusion, where the legacy emitters leave it bare), and its child processes get no legacy
    flag."""
    assert conftest.FAST_EMITTERS not in os.environ["XLA_FLAGS"]
    assert _fusions(_program().compile()) == 1
    if conftest._EMITTERS["switching"]:
        assert _fusions(_program().compile({conftest.EMITTER_OPTION: False})) == 0
