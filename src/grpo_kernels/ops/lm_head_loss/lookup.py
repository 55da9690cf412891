r"""The input-embedding lookup of a tied LM head, whose table gradient is formed in place.

A tied head's weights are also the input embedding :math:`E`, so a training step's gradient
of that table has two parts: the head's, a dense :math:`D` (from
:func:`~grpo_kernels.grpo_loss_from_hidden`), and the lookup's: for :math:`x_n = E_{y_n}` with
cotangent :math:`g_n`,

.. math:: \frac{\partial L}{\partial E_v} = D_v + \sum_{n:\, y_n = v} g_n .

Autodiff of ``table[ids]`` forms the sum as a scatter-add into zeros shaped like the table,
then adds :math:`D`. XLA:CPU widens a bfloat16 scatter-add to float32, so that plans a float32
copy of the table (1.16 GiB at V=151,936, H=2048) next to :math:`D`: more than the fused head's
whole pass. :func:`tied_lookup` returns the rows together with the table for the head to use,
and its backward pass receives :math:`D` and writes the rows' sums into it:

1. duplicates summed first, in float32, over the at most ``N`` distinct ids (``[N, H]``);
2. for each distinct id, :math:`D_v` read, the sum added in float32, the result rounded to the
   table's dtype once;
3. those rows written over :math:`D`'s by plain assignment of 16-bit patterns, slab by slab
   (:func:`.xla_vocab.in_slabs`): the extra memory is two slabs, a quarter of the table.

Each row touched is rounded once (autodiff rounds the lookup's sum, then the addition); float32
tables take a plain scatter-add into :math:`D`, which has no such copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_kernels.ops.lm_head_loss.xla_vocab import in_slabs

Array = jax.Array


def _rows_written(ids: Array, rows: int) -> Array:
    """The row each id's cotangent goes to, as the transpose of ``table[ids]`` sends it:
    negative ids count from the end; ids still outside ``[0, rows)`` (read clamped) give no
    gradient, and become ``rows``, which every write below drops."""
    ids = jnp.where(ids < 0, ids + rows, ids)
    return jnp.where((ids >= 0) & (ids < rows), ids, rows)


@jax.custom_vjp
def tied_lookup(table: Array, ids: Array) -> tuple[Array, Array]:
    r"""``(table[ids], table)``: the rows of ``table [V, H]`` at integer ``ids [...]``
    (``[..., H]``), and the table itself for its other use, a tied head.

    Indices mean what they mean in ``table[ids]`` (negative ones count from the end,
    out-of-range ones are read clamped and get no gradient). The gradient w.r.t. ``table`` is
    the other use's :math:`D` plus the scatter-add of the rows' cotangents
    :math:`\sum_{n: y_n = v} g_n`, summed in float32 and rounded to the table's dtype once per
    row; for 16-bit tables it is written into :math:`D` without a float32 copy of the table
    (see the module docstring). A table used only for the lookup gets :math:`D = 0`. ``ids``
    get no gradient.
    """
    return table[ids], table


def _tied_fwd(table: Array, ids: Array) -> tuple[tuple[Array, Array], Array]:
    return (table[ids], table), ids


def _tied_bwd(ids: Array, cotangents: tuple[Array, Array]) -> tuple[Array, None]:
    g, grad = cotangents
    rows = grad.shape[0]
    ids = _rows_written(ids.reshape(-1), rows)
    g = g.reshape(ids.shape[0], grad.shape[1])
    if grad.dtype.itemsize != 2:
        return grad.at[ids].add(g.astype(grad.dtype), mode="drop"), None
    n = ids.shape[0]
    # Distinct ids (padded with `rows`, dropped below) and each token's place among them.
    unique, where = jnp.unique(ids, size=n, fill_value=rows, return_inverse=True)
    sums = jax.ops.segment_sum(g.astype(jnp.float32), where.reshape(-1), num_segments=n)
    new = grad[jnp.minimum(unique, rows - 1)].astype(jnp.float32) + sums
    bits = jax.lax.bitcast_convert_type(new.astype(grad.dtype), jnp.uint16)

    def fill(start, width, slab, carry):
        at = unique - start
        at = jnp.where((at >= 0) & (at < width), at, width)  # rows of other slabs: dropped
        return slab.at[at].set(bits, mode="drop"), carry

    grad, _ = in_slabs(rows, 1, grad, 0, fill, None, keep=True)
    return grad, None


tied_lookup.defvjp(_tied_fwd, _tied_bwd)
