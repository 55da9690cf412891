"""tied_lookup: the rows of ``table[ids]``, and a table gradient formed in the tied head's.

Oracle: NumPy float64, ``D + sum of each row's cotangents``, rounded to the table's dtype once.
"""

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

from grpo_kernels.ops.lm_head_loss.lookup import tied_lookup
from grpo_kernels.ops.lm_head_loss.xla_vocab import DWEIGHT_SLABS

# XLA:CPU up to jaxlib 0.11 widens a bfloat16 scatter-add (the gradient of ``table[ids]``)
# to a float32 buffer the table's size; jaxlib 0.12's writes it in place. tied_lookup's
# saving is a claim about the first (docs/integrations/tunix.md, "The actor update").
WIDENS_BF16_SCATTER = tuple(int(x) for x in jaxlib.__version__.split(".")[:2]) < (0, 12)
# Not a multiple of DWEIGHT_SLABS: the last slab is narrower than the others.
VOCAB, HIDDEN = 203, 8


def _case(dtype, seed, shape=(3, 40), low=0, high=VOCAB):
    k = jax.random.split(jax.random.key(seed), 4)
    table = jax.random.normal(k[0], (VOCAB, HIDDEN), dtype)
    ids = jax.random.randint(k[1], shape, low, high)
    g = jax.random.normal(k[2], shape + (HIDDEN,), dtype)  # the rows' cotangent
    d = jax.random.normal(k[3], (VOCAB, HIDDEN), dtype)  # the tied head's table gradient
    return table, ids, g, d


def _table_grad(lookup, table, ids, g, d):
    _, vjp = jax.vjp(lambda t: lookup(t, ids), table)
    return vjp((g, d))[0]


def _oracle(ids, g, d):
    want = np.asarray(d, np.float64).copy()
    rows = np.where(np.asarray(ids) < 0, np.asarray(ids) + VOCAB, np.asarray(ids)).ravel()
    keep = (rows >= 0) & (rows < VOCAB)  # read clamped beyond the table: no gradient
    np.add.at(want, rows[keep], np.asarray(g, np.float64).reshape(-1, HIDDEN)[keep])
    return want


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rows_and_table_are_those_of_indexing(dtype):
    table, ids, _, _ = _case(dtype, 0, low=-VOCAB - 5, high=VOCAB + 5)
    rows, same = tied_lookup(table, ids)
    assert rows.dtype == table.dtype and rows.shape == ids.shape + (HIDDEN,)
    np.testing.assert_array_equal(np.asarray(rows, np.float32), np.asarray(table[ids], np.float32))
    assert same is table or bool(jnp.all(same == table))


def test_bf16_gradient_is_the_float64_sum_rounded_once():
    """Many repeats (40 x 3 ids over 20 rows), ids in every slab: each row of the result is
    D + sum of its cotangents, rounded to bfloat16 once; rows never looked up keep D."""
    table, ids, g, d = _case(jnp.bfloat16, 1, high=20)
    ids = ids * (VOCAB // 20)  # spread over all slabs, the narrow last one too
    got = _table_grad(tied_lookup, table, ids, g, d)
    assert got.dtype == jnp.bfloat16
    want = np.asarray(jnp.asarray(_oracle(ids, g, d), jnp.float32).astype(jnp.bfloat16),
                      np.float32)
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    untouched = np.setdiff1d(np.arange(VOCAB), np.asarray(ids))
    np.testing.assert_array_equal(np.asarray(got, np.float32)[untouched],
                                  np.asarray(d, np.float32)[untouched])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_indices_outside_the_table_as_indexing_transposes_them(dtype):
    """Negative ids count from the end; ids beyond the table (read clamped) add nothing."""
    table, ids, g, d = _case(dtype, 2, low=-VOCAB - 30, high=VOCAB + 30)
    got = np.asarray(_table_grad(tied_lookup, table, ids, g, d), np.float64)
    plain = np.asarray(_table_grad(lambda t, i: (t[i], t), table, ids, g, d), np.float64)
    want = _oracle(ids, g, d)
    ulp = 2.0 ** -7 if dtype == jnp.bfloat16 else 2.0 ** -22
    np.testing.assert_allclose(got, want, rtol=ulp, atol=ulp)
    np.testing.assert_allclose(got, plain, rtol=2 * ulp, atol=2 * ulp)


def test_a_table_used_only_for_the_lookup():
    """No head: D is zero, the gradient is the scatter-add alone."""
    table, ids, g, _ = _case(jnp.bfloat16, 3)
    got = jax.grad(lambda t: jnp.sum(tied_lookup(t, ids)[0].astype(jnp.float32)
                                     * g.astype(jnp.float32)))(table)
    want = _oracle(ids, g, jnp.zeros_like(table))
    np.testing.assert_array_equal(
        np.asarray(got, np.float32),
        np.asarray(jnp.asarray(want, jnp.float32).astype(jnp.bfloat16), np.float32))


@pytest.mark.default_emitters
def test_bf16_table_gradient_plans_no_float32_copy_of_the_table():
    """Compile-only: autodiff of ``table[ids]`` plans a float32 scatter-add the table's size
    on XLA:CPU; tied_lookup's plan stays near its two slabs plus the ``[N, H]`` sums."""
    vocab, hidden, n = 8192, 256, 256
    args = (jax.ShapeDtypeStruct((vocab, hidden), jnp.bfloat16),
            jax.ShapeDtypeStruct((n,), jnp.int32),
            jax.ShapeDtypeStruct((n, hidden), jnp.bfloat16),
            jax.ShapeDtypeStruct((vocab, hidden), jnp.bfloat16))

    def temp(lookup):
        step = jax.jit(lambda t, i, g, d: _table_grad(lookup, t, i, g, d))
        return step.lower(*args).compile().memory_analysis().temp_size_in_bytes

    table = 2 * vocab * hidden
    ours, plain = temp(tied_lookup), temp(lambda t, i: (t[i], t))
    assert ours <= (2 / DWEIGHT_SLABS + 0.1) * table, (ours, plain, table)
    if jax.default_backend() == "cpu":
        if WIDENS_BF16_SCATTER:  # what is avoided there (another backend may not widen)
            assert plain >= 1.5 * table, (ours, plain, table)
        else:  # the plain gradient is written in place: nothing to avoid on this compiler
            assert plain < 0.1 * table, (ours, plain, table)
