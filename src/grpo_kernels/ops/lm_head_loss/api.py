"""``grpo_loss_from_hidden``: argument checks and the choice of implementation."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective.segments import Segments
from grpo_kernels.objective.batch import TokenBatch
from grpo_kernels.ops.core.dtypes import common_dtype
from grpo_kernels.ops.core.validate import (
    check_ids_in_range,
    check_softcap,
    resolve_impl,
    shape_of,
    validate_token_inputs,
)
from grpo_kernels.ops.lm_head_loss.head import LAYOUTS, HeadFormat
from grpo_kernels.ops.lm_head_loss.pallas_options import LmHeadPallasOptions
from grpo_kernels.ops.lm_head_loss.pallas_tpu import pallas_lm_head_loss
from grpo_kernels.ops.lm_head_loss.reference import reference_lm_head_loss
from grpo_kernels.ops.lm_head_loss.xla import LmHeadBlockSizes, xla_lm_head_loss

Array = jax.Array

# Every implementation: fn(hidden, lm_head, bias, batch, config, fmt, options).
IMPLEMENTATIONS: dict[str, Callable[..., tuple[Array, dict[str, Array]]]] = {
    "reference": reference_lm_head_loss,
    "xla": xla_lm_head_loss,
    "pallas": pallas_lm_head_loss,
}
IMPL_CHOICES: tuple[str, ...] = ("auto", *IMPLEMENTATIONS)
OPTION_TYPES: dict[str, type] = {"xla": LmHeadBlockSizes, "pallas": LmHeadPallasOptions}
FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _float_dtype(name: str, x: Any) -> None:
    shape_of(name, x)
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")


def validate_head(hidden: Any, lm_head: Any, layout: Any, bias: Any,
                  logits_dtype: Any, logit_softcap: Any = None) -> HeadFormat:
    """Checks the head arguments; returns their :class:`HeadFormat` (``logits_dtype``
    resolved). ValueError names the argument.

    Allowed dtypes: ``hidden``, ``lm_head`` and ``bias`` each bfloat16, float16 or float32, in
    any mix. Matmuls accumulate in float32; a mix computes in float32 (the narrower operand is
    upcast, ``lm_head`` once per call) and gives float32 logits unless ``logits_dtype`` says
    otherwise. ``logit_softcap``: :func:`~grpo_kernels.ops.core.validate.check_softcap`.
    """
    softcap = check_softcap(logit_softcap)
    _float_dtype("hidden", hidden)
    _float_dtype("lm_head", lm_head)
    if hidden.ndim != 3:
        raise ValueError(f"hidden must have rank 3 [B, T, H], got shape {tuple(hidden.shape)}")
    if min(hidden.shape) < 1:
        raise ValueError(f"hidden must have B, T, H >= 1, got shape {tuple(hidden.shape)}")
    if layout not in LAYOUTS:
        raise ValueError(f"lm_head_layout must be one of {LAYOUTS}, got {layout!r}")
    h = hidden.shape[-1]
    if lm_head.ndim != 2:
        raise ValueError(f"lm_head must have rank 2 ([H, V] for layout 'hv', [V, H] for 'vh'), "
                         f"got shape {tuple(lm_head.shape)}")
    h_axis = 0 if layout == "hv" else 1
    if lm_head.shape[h_axis] != h:
        want = f"[H, V] = [{h}, V]" if layout == "hv" else f"[V, H] = [V, {h}]"
        raise ValueError(f"lm_head with lm_head_layout={layout!r} must have shape {want} "
                         f"(H from hidden), got {tuple(lm_head.shape)}")
    vocab = lm_head.shape[1 - h_axis]
    if vocab < 1:
        raise ValueError(f"lm_head must have V >= 1, got shape {tuple(lm_head.shape)}")
    if bias is not None:
        _float_dtype("bias", bias)
        if tuple(bias.shape) != (vocab,):
            raise ValueError(f"bias must have shape [V] = ({vocab},), got {tuple(bias.shape)}")
    if logits_dtype is None:
        return HeadFormat(layout, common_dtype(hidden.dtype, lm_head.dtype), softcap)
    try:
        resolved = jnp.dtype(logits_dtype)
    except TypeError:
        resolved = None
    if resolved not in FLOAT_DTYPES:
        raise ValueError(f"logits_dtype must be None, bfloat16, float16 or float32, "
                         f"got {logits_dtype!r}")
    return HeadFormat(layout, resolved, softcap)


def validate_call(hidden: Any, lm_head: Any, ids: Any, mask: Any, advantages: Any, config: Any,
                  old_logps: Any, ref_logps: Any, layout: Any, bias: Any,
                  logits_dtype: Any, sampler_weights: Any = None,
                  sampler_logps: Any = None, logit_softcap: Any = None,
                  segments: Any = None) -> HeadFormat:
    """Every check of a fused call (the head's, then the logits-level ones on the logits it
    would form); returns the head's format."""
    fmt = validate_head(hidden, lm_head, layout, bias, logits_dtype, logit_softcap)
    b, t, _ = hidden.shape
    validate_token_inputs(jax.ShapeDtypeStruct((b, t, fmt.vocab(lm_head)), fmt.logits_dtype),
                          ids, mask, advantages, config, old_logps, ref_logps, sampler_weights,
                          sampler_logps, segments)
    return fmt


def default_impl(backend: str | None = None) -> str:
    """``impl="auto"``: ``xla`` everywhere until a TPU bench shows the Pallas kernel ahead.

    The Pallas TPU kernel is lowering-tested at B=1, T=8192, H=4096, V=151,936 but has no TPU timing
    recorded; on CPU it runs interpreted (tests only).
    """
    del backend
    return "xla"


def grpo_loss_from_hidden(
    hidden: Array,
    lm_head: Array,
    ids: Array,
    mask: Array,
    advantages: Array,
    *,
    config: GRPOLossConfig,
    old_logps: Array | None = None,
    ref_logps: Array | None = None,
    num_items_in_batch: Array | float | None = None,
    sampler_weights: Array | None = None,
    sampler_logps: Array | None = None,
    segments: Segments | None = None,
    impl: str = "auto",
    lm_head_layout: str = "hv",
    bias: Array | None = None,
    logits_dtype: Any = None,
    check_ids: bool = False,
    options: LmHeadBlockSizes | LmHeadPallasOptions | None = None,
    logit_softcap: float | None = None,
) -> tuple[Array, dict[str, Array]]:
    r"""GRPO loss from hidden states and LM-head weights, never materialising ``[B, T, V]``.

    The logits are :math:`z = \mathrm{cast}_{\text{logits\_dtype}}(h W + b)` (float32
    accumulation, one rounding), and the loss is exactly :func:`grpo_kernels.grpo_loss` of
    them: TRL GRPOTrainer semantics, every ``loss_type``, token or sequence level, KL, delta,
    temperature. The fused implementations form ``z`` a chunk of tokens at a time.

    ``ids``, ``mask``, ``advantages``, ``config``, ``old_logps``, ``ref_logps``,
    ``num_items_in_batch``, ``sampler_weights``, ``sampler_logps``, ``segments`` and
    ``check_ids`` are as in :func:`grpo_kernels.grpo_loss`.

    Args:
      hidden: ``[B, T, H]`` hidden states before the head; position ``t`` predicts
        ``ids[:, t]``.
      lm_head: ``[H, V]`` (``lm_head_layout="hv"``, as ``x @ W``) or ``[V, H]`` (``"vh"``, the
        ``nn.Linear`` / tied-embedding layout).
      impl: ``"auto"`` (``xla``), ``"reference"`` (materialised logits, the baseline),
        ``"xla"`` (chunked, fused) or ``"pallas"`` (TPU kernel; interpret mode on CPU).
      lm_head_layout: ``"hv"`` or ``"vh"``.
      bias: Optional ``[V]`` head bias.
      logits_dtype: Dtype of the logits the loss sees; ``None``: the common dtype of ``hidden``
        and ``lm_head`` (float32 for a mix). ``jnp.float32`` with bfloat16 inputs is an "f32
        head": no rounding of the logits.
      options: ``LmHeadBlockSizes`` for ``xla``, ``LmHeadPallasOptions`` for ``pallas``,
        ``None`` for defaults.
      logit_softcap: :math:`c > 0`: the logits are soft-capped, :math:`c \tanh(z / c)`, after
        the head and before the temperature, with the cap's gradient (Gemma 2); ``reference``
        and ``xla`` only.

    Returns:
      ``(loss, metrics)`` as :func:`grpo_kernels.grpo_loss`; the loss is differentiable w.r.t.
      ``hidden``, ``lm_head`` and ``bias`` (gradients in their dtypes).

    Raises:
      ValueError: at trace time, naming the argument and the expected shape or dtype.

    Example:
      The fused loss equals the logits-level loss of ``hidden @ W``, and so do its gradients:

      >>> import jax, jax.numpy as jnp
      >>> from grpo_kernels import GRPOLossConfig, grpo_loss, grpo_loss_from_hidden
      >>> h = jax.random.normal(jax.random.key(0), (2, 5, 16))
      >>> w = jax.random.normal(jax.random.key(1), (16, 64)) * 0.3
      >>> ids = jax.random.randint(jax.random.key(2), (2, 5), 0, 64)
      >>> mask, adv = jnp.ones((2, 5)), jnp.array([1.0, -1.0])
      >>> old = jax.random.normal(jax.random.key(3), (2, 5)) * 0.1 - 4.0
      >>> cfg = GRPOLossConfig(loss_type="dapo")
      >>> fused = lambda h: grpo_loss_from_hidden(h, w, ids, mask, adv, config=cfg,
      ...                                         old_logps=old, impl="xla")[0]
      >>> plain = lambda h: grpo_loss(h @ w, ids, mask, adv, config=cfg, old_logps=old,
      ...                             impl="reference")[0]
      >>> bool(jnp.allclose(fused(h), plain(h), atol=1e-6))
      True
      >>> bool(jnp.allclose(jax.grad(fused)(h), jax.grad(plain)(h), atol=1e-5))
      True
    """
    impl = resolve_impl(impl, options, OPTION_TYPES, default_impl)
    fmt = validate_call(hidden, lm_head, ids, mask, advantages, config, old_logps, ref_logps,
                        lm_head_layout, bias, logits_dtype, sampler_weights, sampler_logps,
                        logit_softcap, segments)
    if check_ids:
        check_ids_in_range(ids, mask, fmt.vocab(lm_head))
    batch = TokenBatch.of(ids, mask, advantages, old_logps, ref_logps, num_items_in_batch,
                          sampler_weights, sampler_logps, segments)
    return IMPLEMENTATIONS[impl](hidden, lm_head, bias, batch, config, fmt, options)
