"""``grpo_loss``: argument checks and the choice of implementation."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.ops.logits_loss.pallas import PallasOptions, pallas_grpo_loss
from grpo_kernels.ops.logits_loss.reference import reference_grpo_loss
from grpo_kernels.ops.logits_loss.xla import XlaBlockSizes, xla_grpo_loss

Array = jax.Array

IMPLEMENTATIONS: dict[str, Callable[..., tuple[Array, dict[str, Array]]]] = {
    "reference": reference_grpo_loss,
    "xla": xla_grpo_loss,
    "pallas": pallas_grpo_loss,
}
IMPL_CHOICES: tuple[str, ...] = ("auto", *IMPLEMENTATIONS)


def _shape_of(name: str, x: Any) -> tuple[int, ...]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(x.shape)


def _check_shape(name: str, x: Any, expected: tuple[int, ...], what: str) -> None:
    shape = _shape_of(name, x)
    if shape != expected:
        raise ValueError(f"{name} must have shape {what} = {expected}, got {shape}")


def _check_ids_in_range(ids: Array, mask: Array, vocab: int) -> None:
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


def validate_inputs(
    logits: Any,
    ids: Any,
    mask: Any,
    advantages: Any,
    config: Any,
    old_logps: Any,
    ref_logps: Any,
) -> None:
    """Checks ranks, shapes and dtypes at trace time; raises ValueError naming the argument."""
    if not isinstance(config, GRPOLossConfig):
        raise ValueError(f"config must be a GRPOLossConfig, got {type(config).__name__}")
    shape = _shape_of("logits", logits)
    if len(shape) != 3:
        raise ValueError(f"logits must have rank 3 [B, T, V], got shape {shape}")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"logits must be a floating dtype (bfloat16 or float32), got {logits.dtype}")
    b, t, v = shape
    if min(b, t, v) < 1:
        raise ValueError(f"logits must have B, T, V >= 1, got shape {shape}")
    _check_shape("ids", ids, (b, t), "[B, T]")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids must be an integer dtype, got {ids.dtype}")
    _check_shape("mask", mask, (b, t), "[B, T]")
    _check_shape("advantages", advantages, (b,), "[B]")
    for name, x in (("old_logps", old_logps), ("ref_logps", ref_logps)):
        if x is not None:
            _check_shape(name, x, (b, t), "[B, T]")
    for name, x in (("mask", mask), ("advantages", advantages), ("old_logps", old_logps),
                    ("ref_logps", ref_logps)):
        if x is not None and not (jnp.issubdtype(x.dtype, jnp.number) or x.dtype == jnp.bool_):
            raise ValueError(f"{name} must be numeric, got dtype {x.dtype}")
    if config.beta > 0 and ref_logps is None:
        raise ValueError(f"ref_logps [B, T] = {(b, t)} is required when config.beta > 0 "
                         f"(beta={config.beta})")


OPTION_TYPES: dict[str, type] = {"xla": XlaBlockSizes, "pallas": PallasOptions}


def resolve_impl(impl: Any, block_sizes: Any, option_types: dict[str, type],
                 default: Callable[[], str]) -> str:
    """Checks ``impl`` and that ``block_sizes`` fits it; returns the implementation's name.

    ``"auto"`` becomes ``default()``. ``block_sizes`` must be ``None`` or an instance of
    ``option_types[impl]``.
    """
    choices = ("auto", "reference", *option_types)
    if impl not in choices:
        raise ValueError(f"impl must be one of {choices}, got {impl!r}")
    if impl == "auto":
        impl = default()
    wants = option_types.get(impl)
    if block_sizes is not None and (wants is None or not isinstance(block_sizes, wants)):
        kinds = " or ".join(f"{t.__name__} for impl={k!r}" for k, t in option_types.items())
        raise ValueError(f"block_sizes must be {kinds}, got {type(block_sizes).__name__} "
                         f"with impl={impl!r}")
    return impl


def as_num_items(num_items_in_batch: Any) -> Array | None:
    """The ``dapo`` normaliser as a float32 scalar (``None`` stays ``None``)."""
    if num_items_in_batch is None:
        return None
    return jnp.asarray(num_items_in_batch, jnp.float32)


# impl="auto" per backend: only choices a measured benchmark on that backend backs. gpu: on an
# H100 (jax 0.11.2, bf16, V = 151,643) pallas ran 1.21 vs xla's 1.35 ms at B=1, T=2048 and
# 2.21 vs 2.40 ms at B=4, T=1024 (docs/benchmarks.md, "GPU"). Backends not listed use xla.
MEASURED_DEFAULTS: dict[str, str] = {"gpu": "pallas"}


def default_impl(backend: str | None = None) -> str:
    """The implementation ``impl="auto"`` resolves to on ``backend`` (default: JAX's).

    :data:`MEASURED_DEFAULTS` where a benchmark on that backend measured a winner, else
    ``xla``, which beats ``reference`` in time and memory everywhere it was measured (CPU and
    GPU). TPU has no measurement yet; ``pallas`` runs only interpreted on CPU.
    """
    backend = backend or jax.default_backend()
    backend = "gpu" if backend in ("cuda", "rocm") else backend
    return MEASURED_DEFAULTS.get(backend, "xla")


def grpo_loss(
    logits: Array,
    ids: Array,
    mask: Array,
    advantages: Array,
    *,
    config: GRPOLossConfig,
    old_logps: Array | None = None,
    ref_logps: Array | None = None,
    num_items_in_batch: Array | float | None = None,
    impl: str = "auto",
    check_ids: bool = False,
    block_sizes: XlaBlockSizes | PallasOptions | None = None,
) -> tuple[Array, dict[str, Array]]:
    r"""GRPO policy loss with Hugging Face TRL GRPOTrainer semantics.

    With :math:`s = z / \tau` and :math:`\log\pi_{bt} = \mathrm{log\_softmax}(s_{bt})[y_{bt}]`
    (always float32):

    .. math::

        r_{bt} &= \log\pi_{bt} - \log\pi^{old}_{bt}\ \text{(token)}\quad\text{or}\quad
          \frac{\sum_s m_{bs}(\log\pi_{bs} - \log\pi^{old}_{bs})}{\max(\sum_s m_{bs}, 1)}
          \ \text{(sequence)} \\
        \ell_{bt} &= -\min\big(\min(e^{r_{bt}}, \delta) A_b,\
          \mathrm{clip}(e^{r_{bt}}, 1-\epsilon_{low}, 1+\epsilon_{high}) A_b\big)
          + \beta\,(e^{\rho_{bt}-\log\pi_{bt}} - (\rho_{bt}-\log\pi_{bt}) - 1) \\
        L &= \textstyle\sum_{bt} w_{bt}\,\ell_{bt}

    with :math:`w` the ``loss_type`` weights of :func:`grpo_kernels.objective.token_weights`
    (``grpo``: per-sequence token mean then batch mean; ``bnpo``: batch token mean; ``dr_grpo``:
    sum over ``B * max_completion_length``; ``dapo``: sum over ``num_items_in_batch``).

    Args:
      logits: ``[B, T, V]`` bfloat16 or float32; position ``t`` predicts ``ids[:, t]``.
      ids: ``[B, T]`` integer token ids. Ids outside ``[0, V)`` are clamped into range unless
        ``check_ids`` is set; positions with ``mask == 0`` are never checked.
      mask: ``[B, T]`` completion mask in {0, 1} (any numeric or bool dtype).
      advantages: ``[B]`` advantages.
      config: Loss options.
      old_logps: ``[B, T]`` sampling-policy log-probs; ``None``: on-policy.
      ref_logps: ``[B, T]`` reference log-probs; required when ``config.beta > 0``.
      num_items_in_batch: ``dapo`` normaliser (default: the number of unmasked tokens).
      impl: ``"auto"``, ``"reference"``, ``"xla"`` or ``"pallas"`` (TPU/GPU kernels; interpret
        mode on CPU, for tests only).
      check_ids: Raise ValueError when an unmasked id is outside ``[0, V)`` (at call time for
        concrete inputs, at run time under ``jit``).
      block_sizes: ``XlaBlockSizes`` for ``impl="xla"``, ``PallasOptions`` for ``impl="pallas"``.

    Returns:
      ``(loss, metrics)``: the float32 scalar loss, differentiable w.r.t. ``logits`` (gradient in
      the logits dtype), and metrics without gradient: ``logp`` ``[B, T]``, ``clip_ratio_low``,
      ``clip_ratio_high``, ``clip_ratio_region``, ``kl`` (0 without ``ref_logps``), ``entropy``.

    Raises:
      ValueError: at trace time, naming the argument and the expected shape or value.
    """
    validate_inputs(logits, ids, mask, advantages, config, old_logps, ref_logps)
    impl = resolve_impl(impl, block_sizes, OPTION_TYPES, default_impl)
    if check_ids:
        _check_ids_in_range(ids, mask, logits.shape[-1])
    kwargs: dict[str, Any] = dict(
        config=config, old_logps=old_logps, ref_logps=ref_logps,
        num_items_in_batch=as_num_items(num_items_in_batch),
    )
    if impl in OPTION_TYPES:
        kwargs["block_sizes"] = block_sizes
    return IMPLEMENTATIONS[impl](logits, ids, mask, advantages, **kwargs)
