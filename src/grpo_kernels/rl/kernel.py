"""``loss.kernel``: a training config's options for each implementation of the loss.

The YAML keys them by arm, ``<head>-<impl>`` (the names ``grpo-kernels ab --arms`` takes), so
every arm of an A/B run takes its own; each entry is the fields of that op's option dataclass::

    loss:
      head: logits
      impl: pallas
      kernel:
        logits-pallas: {alias_logits: true, blocks: {block_vocab: 8192}}   # PallasOptions
        fused-xla: {dweight: vocab}                                        # LmHeadBlockSizes

``reference`` has no options; ``impl: auto`` takes the entry of the implementation it resolves
to on this backend. Where an entry is silent the trainer's own defaults apply
(:data:`TRAINER_DEFAULTS`: ``logits-pallas`` writes dlogits over the logits).
"""

from __future__ import annotations

from typing import Any, Mapping

from grpo_kernels.ops import LOSS_HEADS
from grpo_kernels.ops.lm_head_loss import api as head_api
from grpo_kernels.ops.logits_loss import api as logits_api
from grpo_kernels.rl.schema import build, fail

# Per head, the option dataclass of each implementation that has options.
OPTION_TYPES: dict[str, dict[str, type]] = {"logits": logits_api.OPTION_TYPES,
                                            "fused": head_api.OPTION_TYPES}
DEFAULT_IMPL = {"logits": logits_api.default_impl, "fused": head_api.default_impl}
ARMS = tuple(f"{head}-{impl}" for head in LOSS_HEADS for impl in OPTION_TYPES[head])
# Fields the trainer sets where an arm's entry does not. Its logits are an intermediate of the
# update program, dead once the loss has read them, so the Pallas kernels write dlogits over
# them (2.49 GB less in a TPU compile of an 8 x 1,024-token update; docs/training.md).
TRAINER_DEFAULTS: dict[str, dict[str, Any]] = {"logits-pallas": {"alias_logits": True}}


def build_options(key: str, arm: str, values: Any) -> Any:
    """The option dataclass of ``arm`` built from the mapping ``values``; ValueError names
    ``key.arm`` (and the nested field, where the mapping has an unknown one)."""
    if arm not in ARMS:
        fail(f"{key}.{arm!s}", f"names no implementation with options; one of {list(ARMS)} "
             "(reference has none; name the implementation 'auto' resolves to)")
    head, impl = arm.split("-", 1)
    where = f"{key}.{arm}"
    try:
        return build(OPTION_TYPES[head][impl], values, where)
    except ValueError as e:
        message = str(e)
        raise ValueError(message if message.startswith(where) else f"{where}: {message}") \
            from None


def merged_entry(arm: str, kernel: Mapping[str, Any]) -> dict[str, Any]:
    """The fields ``arm`` runs with: ``kernel``'s entry over :data:`TRAINER_DEFAULTS`."""
    return {**TRAINER_DEFAULTS.get(arm, {}), **kernel.get(arm, {})}


def resolve(head: str, impl: str, kernel: Mapping[str, Any],
            key: str = "loss.kernel") -> tuple[str, Any]:
    """``(impl, options)``: ``impl`` with ``auto`` resolved on JAX's backend as the op would,
    and its options from :func:`merged_entry` (``None`` where it is empty)."""
    if impl == "auto":
        impl = DEFAULT_IMPL[head]()
    arm = f"{head}-{impl}"
    values = merged_entry(arm, kernel)
    options = build_options(key, arm, values) if values else None
    if arm == "fused-pallas":  # say so before a model loads, not at the first update
        try:
            (options or head_api.LmHeadPallasOptions()).check_backend()
        except ValueError as e:
            fail("loss.impl", str(e))
    return impl, options
