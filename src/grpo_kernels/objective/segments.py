r"""Packed rows: several sequences in one row of ``[B, T]``, told apart by segment ids.

A packer (tunix's ``pack_sequences``, MaxText's) concatenates sequences into rows and labels
each position with its sequence's id :math:`s_{bt} \in \{0, 1, \dots, S - 1\}`: real sequences
``1..``, padding ``0``. Every per-sequence quantity of the objective (a sequence's token
count, its mean log-ratio, the per-sequence means of an aggregation) is then a per-segment one:

.. math::

    \Sigma_{bk}(x) = \sum_t [s_{bt} = k]\, x_{bt}, \qquad
    c_{bk} = \Sigma_{bk}(m), \qquad a_{bk} = [c_{bk} > 0]\,[k \neq 0]

(:func:`Segments.sum`, the scored tokens per segment, the active segments: the padding
segment is never one). ``S`` is static, as the loss compiles once per shape.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

Array = jax.Array


@functools.partial(jax.tree_util.register_dataclass, data_fields=["ids"],
                   meta_fields=["count"])
@dataclasses.dataclass(frozen=True)
class Segments:
    """The segment layout of packed rows.

    Attributes:
      ids: ``[B, T]`` integer segment id of each position, in ``[0, count)``; 0 is padding.
      count: ``S``, a static bound on the ids (tunix's ``num_segments``, the padding segment
        included).
    """

    ids: Array
    count: int

    def sum(self, values: Array) -> Array:
        r"""``[B, S]`` per-row, per-segment sums :math:`\Sigma_{bk}` of ``[B, T]`` values
        (float32). Ids need not be sorted."""
        ids = self.ids.astype(jnp.int32)
        return jax.vmap(lambda v, i: jax.ops.segment_sum(v, i, num_segments=self.count))(
            values.astype(jnp.float32), ids)

    def per_token(self, per_segment: Array) -> Array:
        """``[B, T]``: each position's entry of a ``[B, S]`` per-segment array."""
        return jnp.take_along_axis(per_segment, self.ids.astype(jnp.int32), axis=1)

    def counts(self, mask: Array) -> Array:
        r"""``[B, S]`` scored tokens per segment, :math:`c_{bk}`."""
        return self.sum(mask)

    def active(self, mask: Array) -> Array:
        r"""``[B, S]`` float32 :math:`a_{bk}`: 1 for a segment with a scored token, 0 for the
        others and always for the padding segment 0."""
        return (self.counts(mask) > 0).astype(jnp.float32).at[:, 0].set(0.0)

    def sequence_mean(self, values: Array, mask: Array) -> Array:
        r"""``[B, T]``: each position's segment mean :math:`\Sigma_{bk}(x m) /
        \max(c_{bk}, 1)` (segment 0 too, as tunix pools it)."""
        mask = mask.astype(jnp.float32)
        return self.per_token(self.sum(values * mask) / jnp.maximum(self.counts(mask), 1.0))
