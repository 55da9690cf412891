"""The sampler's truncation (top-k, top-p, min-p) on a mesh: where each device holds whole rows.

The truncation's floor is a statistic of the whole row (:mod:`grpo_kernels.ops.core.truncation`):
its top-k, its top-p mass and its max. Where nothing splits the vocabulary (no vocab axis, or
one of size 1) each device's block holds whole rows, so the one-device pieces apply to it
unchanged: each device finds its rows' floors, and the kept set, the log-probs and their
gradient follow on the block with no collective beyond the batch sums of the objective. A vocab
axis would need the floor found across shards (a distributed top-k and a bisection over
``psum``-ed masses); the FSDP-gathered xla head (``ShardingSpec.head_axes``) sweeps blocks of
vocabulary columns and never holds a row whole either. Both raise here, naming the way out.
"""

from __future__ import annotations

from grpo_kernels.ops.core.truncation import Truncation
from grpo_kernels.sharding.spec import ShardingSpec


def mesh_truncation(trunc: Truncation | None, spec: ShardingSpec, impl: str,
                    who: str) -> Truncation | None:
    """``trunc``, the sampler's truncation a sharded op was asked for (None, or one that drops
    tokens of the op's rows), once checked against the mesh.

    ``spec`` is the one resolved on the mesh (axes of size 1 already dropped).

    Raises:
      ValueError: the mesh splits the vocabulary, or the xla head gathers an FSDP-split head
        block by block (``head_axes``).
    """
    if trunc is None:
        return None
    if spec.vocab_axis is not None:
        raise ValueError(
            f"top_k / top_p / min_p: {who} truncates only where each device holds whole "
            f"vocabulary rows (the floor is a statistic of the whole row), but the mesh "
            f"splits V over {spec.vocab_axis!r}; use a ShardingSpec with vocab_axis=None")
    if impl == "xla" and spec.head_axes:
        raise ValueError(
            f"top_k / top_p / min_p: {who} with ShardingSpec.head_axes={spec.head_axes} "
            f"gathers the head one block of vocabulary columns at a time and never holds a "
            f"row whole; leave head_axes empty (the head gathered whole on each device)")
    return trunc
