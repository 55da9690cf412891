"""core.validate and core.dtypes: errors name the argument; dtype spellings."""

import jax.numpy as jnp
import numpy as np
import pytest

from grpo_kernels.ops.core.dtypes import cast_to, dtype_name, parse_dtype
from grpo_kernels.ops.core.validate import backend_kind, check_ids_in_range, resolve_impl


class A: ...


class B: ...


def test_resolve_impl():
    types = {"xla": A, "pallas": B}
    assert resolve_impl("auto", None, types, lambda: "xla") == "xla"
    assert resolve_impl("pallas", B(), types, lambda: "xla") == "pallas"
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'reference', 'xla', "):
        resolve_impl("fast", None, types, lambda: "xla")
    with pytest.raises(ValueError, match="options must be A for impl='xla' or B for "
                                         "impl='pallas', got A with impl='pallas'"):
        resolve_impl("pallas", A(), types, lambda: "xla")
    with pytest.raises(ValueError, match="with impl='reference'"):
        resolve_impl("reference", A(), types, lambda: "xla")


def test_backend_kind():
    assert [backend_kind(b) for b in ("cuda", "rocm", "tpu", "cpu")] == ["gpu", "gpu", "tpu",
                                                                       "cpu"]


def test_ids_out_of_range_are_named_where_unmasked():
    ids = np.array([[0, 5, 9]]); mask = np.array([[1, 1, 0]])
    check_ids_in_range(ids, np.array([[1, 0, 0]]), 5)  # the bad id is masked out
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 5\) where mask != 0; "
                                         r"ids\[0, 1\] = 5"):
        check_ids_in_range(ids, mask, 5)


@pytest.mark.parametrize("name,want", [("bf16", "bfloat16"), ("bfloat16", "bfloat16"),
                                       ("f32", "float32"), ("float32", "float32")])
def test_dtype_spellings(name, want):
    assert dtype_name(name) == want and jnp.dtype(parse_dtype(name)).name == want


def test_bad_dtype_names_the_choices():
    with pytest.raises(ValueError, match=r"dtype must be one of \['bf16', 'bfloat16'"):
        parse_dtype("fp16")


def test_cast_to_rounds_like_astype():
    x = jnp.asarray(np.random.default_rng(0).normal(0, 3, 1000), jnp.float32)
    np.testing.assert_array_equal(np.asarray(cast_to(x, jnp.bfloat16), np.float32),
                                  np.asarray(x.astype(jnp.bfloat16), np.float32))
