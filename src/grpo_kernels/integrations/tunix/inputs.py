r"""A tunix ``TrainExample`` read into our loss's per-token inputs, and the model's arguments.

Two layouts:

- unpacked: ``prompt_ids [B, P]`` and ``completion_ids [B, T]``; the loss scores the
  completion, each position predicted by the one before it;
- packed (``segment_ids`` set, as tunix's ``pack_sequences`` and MaxText make them):
  ``prompt_ids [B, 0]`` and ``completion_ids [B, L]`` rows of whole sequences (prompts and
  completions, ``segment_ids`` telling them apart, 0 for padding), per-token advantages and
  ``completion_mask`` on completion tokens only. tunix scores positions ``1..L-1`` and gives
  position 0 the log-prob 0; we score the same positions, so the loss is computed on
  ``[B, L - 1]`` and position 0, which opens a row with a prompt (mask 0), is left out. (A
  row that opened with a scored token would count it in tunix's loss with log-prob 0 and be
  left out of ours: no packer makes one.)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from grpo_kernels.integrations.tunix import offers
from grpo_kernels.integrations.tunix.config import field
from grpo_kernels.objective.segments import Segments

Array = jax.Array


class Example(NamedTuple):
    """The per-token inputs of a tunix ``TrainExample`` as our loss takes them: ``[B, t]``
    arrays (``t = T``, or ``L - 1`` for packed rows), ``advantages`` ``[B]`` or ``[B, t]``;
    ``segments``: the packed rows' layout where the installed tunix takes sequence-level
    quantities per segment, else None; ``packed``: whether the rows are packed."""

    ids: Array
    mask: Array
    advantages: Array
    old_logps: Array | None
    ref_logps: Array | None
    sampler_weights: Array | None
    segments: Segments | None = None
    packed: bool = False


def _scored(x: Array | None, packed: bool) -> Array | None:
    """``x`` at the scored positions: all of them, or from 1 on in a packed row."""
    return x if x is None or not packed else x[:, 1:]


def example_inputs(train_example: Any) -> Example:
    """Checks a ``TrainExample`` and returns its per-token inputs (module docstring).

    Raises:
      ValueError: naming the field: advantages that are neither ``[B]`` nor ``[B, T]``, a
        packed example with prompt tokens or, where tunix pools per segment, without
        ``num_segments``.
    """
    completion = train_example.completion_ids
    seg = field(train_example, "segment_ids")
    packed = seg is not None
    advantages = train_example.advantages
    if tuple(advantages.shape) not in ((completion.shape[0],), tuple(completion.shape)):
        raise ValueError(f"train_example.advantages must be [B] (one per completion) or [B, T] "
                         f"(one per token) = {tuple(completion.shape)}, got shape "
                         f"{tuple(advantages.shape)}")
    segments = None
    if packed:
        if train_example.prompt_ids.shape[1] != 0:
            raise ValueError(f"train_example.prompt_ids must be empty ([B, 0]) with segment_ids "
                             f"(packed rows hold prompts and completions in completion_ids), "
                             f"got shape {tuple(train_example.prompt_ids.shape)}")
        if offers.packs_per_segment():
            count = field(train_example, "num_segments")
            if count is None:
                raise ValueError("train_example.num_segments must be set with segment_ids "
                                 "(the static bound on a row's segment ids)")
            segments = Segments(seg[:, 1:], int(count))
    if advantages.ndim == 2:
        advantages = _scored(advantages, packed)
    return Example(_scored(completion, packed), _scored(train_example.completion_mask, packed),
                   advantages.astype(jnp.float32),
                   _scored(train_example.old_per_token_logps, packed),
                   _scored(train_example.ref_per_token_logps, packed),
                   _scored(field(train_example, "sampler_is_weights"), packed), segments, packed)


def model_inputs(model: Any, train_example: Any, pad_id: int, eos_id: int) -> dict[str, Any]:
    """The model's arguments for a ``TrainExample``'s prompt + completion
    (:func:`token_inputs`)."""
    return token_inputs(model, train_example.prompt_ids, train_example.completion_ids, pad_id,
                        eos_id, field(train_example, "segment_ids"),
                        field(train_example, "segment_positions"))


def token_inputs(model: Any, prompt_ids: Array, completion_ids: Array, pad_id: int,
                 eos_id: int, segment_ids: Array | None = None,
                 segment_positions: Array | None = None) -> dict[str, Any]:
    """The model's arguments for prompt + completion, made by tunix's own ``process_ids``
    (packed rows: the given positions, no attention mask), with ``segment_ids`` as tunix's
    log-prob pass passes them: the packed rows' own, else the non-pad mask, and only to a
    model that takes them (:func:`~grpo_kernels.integrations.tunix.offers.model_call_contains`).
    """
    from tunix.rl import common

    tokens, positions, attn_mask, pad_ids = common.process_ids(
        prompt_ids, completion_ids, pad_id, eos_id, segment_ids, segment_positions)
    out = {"input_tokens": tokens, "positions": positions, "attention_mask": attn_mask}
    given = segment_ids if segment_ids is not None else pad_ids
    if given is not None and offers.model_call_contains(model, "segment_ids"):
        out["segment_ids"] = given
    return out
