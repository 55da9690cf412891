"""core.online_softmax: block statistics and their merges against a float64 NumPy softmax."""

import numpy as np
import pytest

import jax.numpy as jnp

from grpo_kernels.ops.core.online_softmax import (
    block_stats,
    finish,
    merge_stats,
    reduce_stats,
    sweep,
)


def _oracle(s):
    s = np.asarray(s, np.float64)
    m = s.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]
    p = np.exp(s - lse[..., None])
    ent = -(p * (s - lse[..., None])).sum(-1)
    return lse, ent


def _rows(seed, rows=5, vocab=300, scale=3.0):
    return np.random.default_rng(seed).normal(0, scale, (rows, vocab)).astype(np.float32)


def test_whole_rows_match_the_oracle():
    s = _rows(0)
    ids = np.arange(len(s)) * 7
    logp, lse, ent = finish(*block_stats(jnp.asarray(s)), jnp.asarray(s[np.arange(len(s)), ids]))
    want_lse, want_ent = _oracle(s)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
    np.testing.assert_allclose(ent, want_ent, rtol=1e-5)
    np.testing.assert_allclose(logp, s[np.arange(len(s)), ids] - want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cuts", [(1,), (128, 256), (7, 8, 299)])
def test_merged_blocks_equal_whole_rows(cuts):
    s = jnp.asarray(_rows(1))
    parts = np.split(np.arange(s.shape[1]), cuts)
    acc = block_stats(s[:, parts[0]])
    for cols in parts[1:]:
        acc = merge_stats(acc, block_stats(s[:, cols]))
    stacked = [np.stack(x, axis=-1) for x in zip(*(block_stats(s[:, c]) for c in parts))]
    for got in (acc, reduce_stats(*map(jnp.asarray, stacked))):
        _, lse, ent = finish(*got, jnp.zeros(s.shape[0]))
        want_lse, want_ent = _oracle(s)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
        np.testing.assert_allclose(ent, want_ent, rtol=1e-5)


def test_an_empty_part_changes_nothing_and_shift_is_free():
    s = jnp.asarray(_rows(2))
    empty = (jnp.full((s.shape[0],), -jnp.inf), jnp.zeros(s.shape[0]), jnp.zeros(s.shape[0]))
    whole = block_stats(s)
    for got in (merge_stats(empty, whole), merge_stats(whole, empty)):
        for a, b in zip(got, whole):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    shifted = block_stats(s, s[:, 0])  # any finite shift: same lse and entropy
    _, lse_a, ent_a = finish(*whole, jnp.zeros(s.shape[0]))
    _, lse_b, ent_b = finish(*shifted, jnp.zeros(s.shape[0]))
    np.testing.assert_allclose(lse_a, lse_b, rtol=1e-6)
    np.testing.assert_allclose(ent_a, ent_b, rtol=1e-4)


@pytest.mark.parametrize("n,block", [(10, 3), (9, 3), (2, 5), (1, 1)])
def test_sweep_visits_each_element_once(n, block):
    visits = sweep(n, block, lambda start, size, acc: acc.at[start + jnp.arange(size)].add(1),
                   jnp.zeros(n, jnp.int32))
    np.testing.assert_array_equal(visits, np.ones(n))
