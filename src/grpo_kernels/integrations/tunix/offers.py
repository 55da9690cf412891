"""What the installed tunix offers, read from its code (classes, fields, signatures,
behaviour), never from its version string.

The integration serves tunix 0.1.7 (PyPI, June 2026) and its development head (what MaxText
installs; vendored at commit c7d8950f for the tests), which differ where our losses meet them:

- a policy loss returns ``(loss, aux)`` on 0.1.7, a ``sft.utils.LossOutput`` of
  ``WeightedMetric`` (sum, denominator) on the head;
- packed rows carry ``segment_ids`` and are aggregated per row on 0.1.7; on the head they also
  carry ``num_segments`` and every sequence-level quantity is per segment;
- an unpacked ``sequence-mean-token-sum-norm`` batch is divided by its non-empty rows on 0.1.7,
  by its rows (``B``) on the head;
- ``compute_per_token_logps`` takes ``return_logits`` on 0.1.7, ``return_entropy`` and
  ``chunk_size`` on the head.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable


@functools.cache
def loss_output() -> type | None:
    """tunix's ``LossOutput`` class (its policy losses return one), or None (they return
    ``(loss, aux)``)."""
    from tunix.sft import utils

    return getattr(utils, "LossOutput", None)


def weighted_metric() -> type:
    """tunix's ``WeightedMetric`` (only where :func:`loss_output` is not None)."""
    from tunix.sft import utils

    return utils.WeightedMetric


@functools.cache
def packs_per_segment() -> bool:
    """Whether a packed ``TrainExample`` carries ``num_segments`` (the head: sequence-level
    quantities per segment) rather than only ``segment_ids`` (0.1.7: per row)."""
    from tunix.rl import common

    return "num_segments" in {f.name for f in dataclasses.fields(common.TrainExample)}


@functools.cache
def sum_norm_by_rows() -> bool:
    """Whether tunix's ``sequence-mean-token-sum-norm`` divides an unpacked batch by its rows
    (the head: ``B``) rather than by its non-empty rows (0.1.7): asked of its own
    ``aggregate_loss`` on two rows, one of them empty."""
    import numpy as np
    from tunix.rl import common

    out = common.aggregate_loss(np.ones((2, 1), np.float32), np.array([[1.0], [0.0]], np.float32),
                                "sequence-mean-token-sum-norm")
    value = out.compute() if hasattr(out, "compute") else out
    return abs(float(value) - 0.5) < 1e-6


def model_call_contains(model: Any, name: str) -> bool:
    """tunix's rule for passing ``segment_ids`` to a model: its own ``model_call_contains``
    where it has one (the head looks through a ``transformer`` attribute), else 0.1.7's
    (the model's ``__call__`` takes ``name`` or ``**kwargs``)."""
    from tunix.rl import common

    own = getattr(common, "model_call_contains", None)
    if own is not None:
        return own(model, name)
    from grpo_kernels.integrations.tunix.models import call_accepts

    return call_accepts(model, name)


def chunks_log_probs() -> bool:
    """Whether the installed tunix's ``compute_per_token_logps`` takes the head's
    ``chunk_size`` (its opt-in chunked pass; 0.1.7 has none). Not cached: the proof's programs
    read it after putting another tunix first on the import path."""
    from tunix.rl import common

    return "chunk_size" in parameters(common.compute_per_token_logps)


def parameters(fn: Callable) -> tuple[str, ...]:
    """The parameter names of ``fn`` (a jitted function's, through ``__wrapped__``)."""
    return tuple(inspect.signature(fn).parameters)
