"""Argument checks shared by both ops and the sharding layer; every error names the argument."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective.segments import Segments
from grpo_kernels.objective.weights import SCALE_NEEDS_NORM
from grpo_kernels.ops.core.platform import PLATFORMS

Array = jax.Array


def shape_of(name: str, x: Any) -> tuple[int, ...]:
    """``x.shape``; ValueError naming ``name`` when ``x`` is not an array."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(x.shape)


def check_shape(name: str, x: Any, expected: tuple[int, ...], what: str) -> None:
    shape = shape_of(name, x)
    if shape != expected:
        raise ValueError(f"{name} must have shape {what} = {expected}, got {shape}")


def check_ids_in_range(ids: Array, mask: Array, vocab: int) -> None:
    """Raises ValueError if a masked-in id lies outside ``[0, vocab)``.

    Concrete inputs are checked at once; under ``jit`` a host callback raises when the
    computation runs (surfacing as a runtime error that carries this message).
    """

    def check(ids_np, mask_np):
        bad = (np.asarray(mask_np) != 0) & ((ids_np < 0) | (ids_np >= vocab))
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"ids must lie in [0, {vocab}) where mask != 0; ids{list(where)} = "
                f"{int(ids_np[where])} ({int(bad.sum())} id(s) out of range)"
            )

    if isinstance(ids, jax.core.Tracer) or isinstance(mask, jax.core.Tracer):
        jax.debug.callback(check, ids, mask)
    else:
        check(np.asarray(ids), np.asarray(mask))


def validate_token_inputs(
    logits: Any,
    ids: Any,
    mask: Any,
    advantages: Any,
    config: Any,
    old_logps: Any,
    ref_logps: Any,
    sampler_weights: Any = None,
    sampler_logps: Any = None,
    segments: Any = None,
) -> None:
    """Checks ranks, shapes and dtypes at trace time; raises ValueError naming the argument.

    ``logits`` may be a ``jax.ShapeDtypeStruct`` (the fused op checks the logits it will form).
    ``advantages`` may be ``[B]`` or ``[B, T]``; ``segments`` (packed rows) is checked by
    :func:`check_segments`.
    """
    if not isinstance(config, GRPOLossConfig):
        raise ValueError(f"config must be a GRPOLossConfig, got {type(config).__name__}")
    shape = shape_of("logits", logits)
    if len(shape) != 3:
        raise ValueError(f"logits must have rank 3 [B, T, V], got shape {shape}")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"logits must be a floating dtype (bfloat16 or float32), got {logits.dtype}")
    b, t, v = shape
    if min(b, t, v) < 1:
        raise ValueError(f"logits must have B, T, V >= 1, got shape {shape}")
    check_shape("ids", ids, (b, t), "[B, T]")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids must be an integer dtype, got {ids.dtype}")
    check_shape("mask", mask, (b, t), "[B, T]")
    if shape_of("advantages", advantages) != (b, t):
        check_shape("advantages", advantages, (b,), "[B] (or [B, T], one per token)")
    per_token = (("old_logps", old_logps), ("ref_logps", ref_logps),
                 ("sampler_weights", sampler_weights), ("sampler_logps", sampler_logps))
    for name, x in per_token:
        if x is not None:
            check_shape(name, x, (b, t), "[B, T]")
    for name, x in (("mask", mask), ("advantages", advantages), *per_token):
        if x is not None and not (jnp.issubdtype(x.dtype, jnp.number) or x.dtype == jnp.bool_):
            raise ValueError(f"{name} must be numeric, got dtype {x.dtype}")
    if config.beta > 0 and ref_logps is None:
        raise ValueError(f"ref_logps [B, T] = {(b, t)} is required when config.beta > 0 "
                         f"(beta={config.beta})")
    if config.needs_sampler_logps and sampler_logps is None:
        raise ValueError(f"sampler_logps [B, T] = {(b, t)} is required when "
                         f"config.sampler_correction is set "
                         f"(sampler_correction={config.sampler_correction!r})")
    if segments is not None:
        check_segments(segments, config, b, t)


# TRL loss types whose weights do not look at sequences (token means, num_items_in_batch).
TOKEN_LEVEL_LOSS_TYPES: tuple[str, ...] = ("bnpo", "dapo", "cispo")


def check_segments(segments: Any, config: GRPOLossConfig, b: int, t: int) -> None:
    """Checks packed rows' layout and that ``config`` defines every sequence-level quantity
    per segment; ValueError naming the argument or the option that does not.

    Per segment: tunix's aggregations (``loss_agg_mode``; ``sequence-mean-token-scale``
    with ``loss_agg_norm``), the token-level TRL normalisations (``bnpo``, ``dapo``,
    ``cispo``), the three importance-sampling levels. Not (they would pool a row's sequences
    together): the per-sequence TRL normalisations (``grpo``, ``sapo``, ``luspo``,
    ``dr_grpo``) without a ``loss_agg_mode``, VESPO's sequence weight, the off-policy
    sequence mask and the sequence-level sampler corrections.
    """
    if not isinstance(segments, Segments):
        raise ValueError(f"segments must be a grpo_kernels.Segments(ids, count), got "
                         f"{type(segments).__name__}")
    check_shape("segments.ids", segments.ids, (b, t), "[B, T]")
    if not jnp.issubdtype(segments.ids.dtype, jnp.integer):
        raise ValueError(f"segments.ids must be an integer dtype, got {segments.ids.dtype}")
    count = segments.count
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        raise ValueError(f"segments.count must be an int >= 1 (a static bound on the ids, "
                         f"padding segment 0 included), got {count!r}")
    unsupported = []
    if config.loss_agg_mode is None and config.loss_type not in TOKEN_LEVEL_LOSS_TYPES:
        unsupported.append(f"loss_type={config.loss_type!r} without loss_agg_mode (its "
                           f"weights are per row; packed rows take loss_agg_mode or one of "
                           f"{TOKEN_LEVEL_LOSS_TYPES})")
    if config.loss_type == "vespo":
        unsupported.append("loss_type='vespo' (a per-row sequence weight)")
    if config.off_policy_mask_threshold is not None:
        unsupported.append("off_policy_mask_threshold (a per-row sequence mask)")
    if (config.sampler_correction or "").startswith("sequence"):
        unsupported.append(f"sampler_correction={config.sampler_correction!r} (per row)")
    if config.loss_agg_mode == "sequence-mean-token-scale" and config.loss_agg_norm is None:
        unsupported.append(SCALE_NEEDS_NORM)
    if unsupported:
        raise ValueError("segments (packed rows) are not supported with " +
                         "; ".join(unsupported))


def check_softcap(value: Any) -> float | None:
    """``logit_softcap`` as a float (or None); ValueError unless None or a finite number > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not np.isfinite(value) or value <= 0:
        raise ValueError(f"logit_softcap must be None or a finite number > 0, got {value!r}")
    return float(value)


def backend_kind(backend: str | None = None) -> str:
    """``cpu``, ``gpu`` or ``tpu`` (CUDA and ROCm are ``gpu``: :data:`.platform.PLATFORMS`) of
    ``backend`` or JAX's default; any other name as it is."""
    backend = backend or jax.default_backend()
    return next((kind for kind, names in PLATFORMS.items() if backend in names), backend)


def resolve_impl(impl: Any, options: Any, option_types: dict[str, type],
                 default: Callable[[], str]) -> str:
    """Checks ``impl`` and that ``options`` fits it; returns the implementation's name.

    ``"auto"`` becomes ``default()``. ``options`` must be ``None`` or an instance of
    ``option_types[impl]``.
    """
    choices = ("auto", "reference", *option_types)
    if impl not in choices:
        raise ValueError(f"impl must be one of {choices}, got {impl!r}")
    if impl == "auto":
        impl = default()
    wants = option_types.get(impl)
    if options is not None and (wants is None or not isinstance(options, wants)):
        kinds = " or ".join(f"{t.__name__} for impl={k!r}" for k, t in option_types.items())
        raise ValueError(f"options must be {kinds}, got {type(options).__name__} "
                         f"with impl={impl!r}")
    return impl
