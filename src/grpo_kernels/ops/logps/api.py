r"""``token_logps`` and ``token_logps_from_hidden``: the policy's log-probs of given tokens.

What a GRPO iteration needs besides the loss: the reference model's log-probs (whenever
``beta != 0``) and the sampling policy's (whenever a batch is reused). With
:math:`s = z / \tau` (optionally :math:`z` soft-capped first, below):

.. math::

    \log\pi_{bt} = s_{bt, y_{bt}} - \log\sum_v e^{s_{btv}}, \qquad
    H_{bt} = -\sum_v \pi_{btv} \log \pi_{btv},

in float32 whatever the logits' dtype. The implementations are the losses' own statistics:

- ``reference``: a float32 ``log_softmax`` of the whole ``[B, T, V]`` (the ground truth);
- ``xla``: the chunked statistics sweep of the logits loss
  (:func:`grpo_kernels.ops.logits_loss.xla.row_statistics`), or the fused head's token loop
  without its gradient (one matmul of the logits' size, :func:`~grpo_kernels.ops.lm_head_loss.
  xla_sweep.head_sweep`): no float32 copy of ``[B, T, V]``, and from hidden states no
  ``[B, T, V]`` at all;
- ``pallas``: the losses' statistics kernels: on logits the GPU (Triton) and TPU (Mosaic)
  row-statistics kernels, from hidden states the TPU head-statistics kernel (no GPU kernel:
  ``impl="auto"`` is ``xla`` there).

The results are differentiable: the backward runs the loss's gradient piece of the same
implementation (:func:`grpo_kernels.ops.core.vjp.with_softmax_gradient`), so a log-prob used
inside a loss costs what the loss's own gradient costs.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from grpo_kernels.ops.core.reference import truncated_token_logps
from grpo_kernels.ops.core.truncation import Truncation
from grpo_kernels.ops.core.validate import (check_ids_in_range, check_shape, check_softcap,
                                            resolve_impl, shape_of)
from grpo_kernels.ops.core.vjp import with_softmax_gradient
from grpo_kernels.ops.lm_head_loss import api as head_api
from grpo_kernels.ops.lm_head_loss import pallas_tpu as head_pallas
from grpo_kernels.ops.lm_head_loss import xla as head_xla
from grpo_kernels.ops.lm_head_loss.head import head_logits
from grpo_kernels.ops.logits_loss import api as logits_api
from grpo_kernels.ops.logits_loss import pallas as logits_pallas
from grpo_kernels.ops.logits_loss import xla as logits_xla

Array = jax.Array


def check_temperature(temperature: Any) -> float:
    """``temperature`` as a float; ValueError unless it is a finite number > 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def check_token_ids(ids: Any, batch: int, time: int, vocab: int, check_ids: bool) -> Array:
    """``ids`` checked (shape ``[B, T]``, integer dtype; with ``check_ids`` every id in
    ``[0, V)``) and clamped into range as int32, the losses' rule."""
    check_shape("ids", ids, (batch, time), "[B, T]")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids must be an integer dtype, got {ids.dtype}")
    if check_ids:
        check_ids_in_range(ids, jnp.ones(ids.shape, jnp.bool_), vocab)
    return jnp.clip(ids.astype(jnp.int32), 0, vocab - 1)


def check_logits(logits: Any) -> tuple[int, int, int]:
    """``(B, T, V)`` of ``logits``; ValueError unless a rank-3 float array with every size >= 1."""
    shape = shape_of("logits", logits)
    if len(shape) != 3:
        raise ValueError(f"logits must have rank 3 [B, T, V], got shape {shape}")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"logits must be a floating dtype, got {logits.dtype}")
    if min(shape) < 1:
        raise ValueError(f"logits must have B, T, V >= 1, got shape {shape}")
    return shape


def from_pieces(stats: Any, grad: Any, primals: tuple, ids: Array, with_entropy: bool,
                truncated: bool = False) -> tuple[Array, Array, Array | None]:
    """``(logp, entropy, outside)`` of an implementation's statistics ``stats``,
    differentiable through its gradient piece ``grad`` (the pair a loss's ``pieces`` gives).
    ``truncated``: pieces made with a sampler's truncation (their statistics give each row's
    floor and ``outside``, their gradient takes ``(ids, floor)``); else ``outside`` is None."""
    out = stats(jax.tree.map(jax.lax.stop_gradient, primals), ids)
    logp, lse, ent = out[:3]
    targets, outside = ((ids, out[3]), out[4]) if truncated else (ids, None)
    logp, ent = with_softmax_gradient(grad, with_entropy, primals, logp, ent, lse, ent,
                                      targets)
    return logp, ent, outside


def requested_truncation(vocab: int, top_k: Any, top_p: Any, min_p: Any,
                         return_outside: Any) -> Truncation | None:
    """The sampler's truncation a log-prob op's arguments ask for (checked), None when it
    drops nothing from a ``vocab``-wide row; ValueError unless ``return_outside`` is a bool."""
    trunc = Truncation(top_k, top_p, min_p)
    if not isinstance(return_outside, bool):
        raise ValueError(f"return_outside must be a bool, got {return_outside!r}")
    return trunc if trunc.active(vocab) else None


def results(logp: Array, ent: Array, outside: Array | None, return_entropy: bool,
            return_outside: bool) -> Array | tuple[Array, ...]:
    """``logp``, then ``ent`` and ``outside`` (all False where None) as the log-prob ops'
    ``return_entropy`` / ``return_outside`` ask."""
    if outside is None:
        outside = jnp.zeros(logp.shape, jnp.bool_)
    out = (logp, *((ent,) if return_entropy else ()), *((outside,) if return_outside else ()))
    return out[0] if len(out) == 1 else out


def token_logps(logits: Array, ids: Array, *, temperature: float = 1.0,
                return_entropy: bool = False, impl: str = "auto",
                options: logits_xla.XlaBlockSizes | logits_pallas.PallasOptions | None = None,
                check_ids: bool = False,
                logit_softcap: float | None = None, top_k: int | None = None,
                top_p: float | None = None, min_p: float | None = None,
                return_outside: bool = False) -> Array | tuple[Array, ...]:
    r"""Per-token log-probs :math:`\log\mathrm{softmax}(z / \tau)[y]` of logits, float32.

    With ``top_k``, ``top_p`` or ``min_p``: the log-probs of the distribution a sampler drew
    from under them (vLLM's processed log-probs: :mod:`grpo_kernels.ops.core.truncation`),
    renormalised over the tokens it keeps and the chosen one.

    Args:
      logits: ``[B, T, V]``, any float dtype; position ``t`` scores ``ids[:, t]``.
      ids: ``[B, T]`` integer token ids; ids outside ``[0, V)`` are clamped into range unless
        ``check_ids`` is set.
      temperature: :math:`\tau > 0`.
      return_entropy: Also return the entropy of each position's distribution.
      impl: ``"auto"`` (``pallas`` on GPU, else ``xla``), ``"reference"``, ``"xla"`` or
        ``"pallas"`` (interpret mode on CPU, for tests).
      options: ``XlaBlockSizes`` for ``xla``, ``PallasOptions`` for ``pallas``.
      check_ids: Raise ValueError for an id outside ``[0, V)``.
      logit_softcap: :math:`c > 0`: the logits soft-capped, :math:`c \tanh(z / c)`, before
        the temperature (``reference`` and ``xla``).
      top_k: Keep the ``top_k`` largest scaled logits of each row (and their ties).
      top_p: Then the smallest top set of probability ``>= top_p``, in ``(0, 1]``.
      min_p: First the tokens of probability ``>= min_p`` times the row's largest.
      return_outside: Also return ``[B, T]`` bool: the chosen token lies outside the kept set
        (its log-prob is then over the kept set and itself).

    Returns:
      ``logp [B, T]`` float32, then ``entropy`` (``return_entropy``) and ``outside``
      (``return_outside``) when asked; differentiable w.r.t. ``logits``. The truncation's
      kept set is a constant of the gradient (every implementation; ``pallas`` takes each
      row's floor from the ``xla`` statistics pass).

    Raises:
      ValueError: naming the argument (shapes, dtypes, temperature, impl, options).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from grpo_kernels import token_logps
      >>> z = jax.random.normal(jax.random.key(0), (2, 3, 11))
      >>> ids = jnp.array([[1, 2, 3], [4, 5, 10]])
      >>> want = jnp.take_along_axis(jax.nn.log_softmax(z), ids[..., None], -1)[..., 0]
      >>> bool(jnp.allclose(token_logps(z, ids, impl="xla"), want, atol=1e-6))
      True
    """
    b, t, vocab = check_logits(logits)
    tau = check_temperature(temperature)
    impl = resolve_impl(impl, options, logits_api.OPTION_TYPES, logits_api.default_impl)
    trunc = requested_truncation(vocab, top_k, top_p, min_p, return_outside)
    softcap = check_softcap(logit_softcap)
    ids = check_token_ids(ids, b, t, vocab, check_ids)
    if impl == "reference":
        logp, ent, outside = truncated_token_logps(logits, ids, tau, softcap, trunc)
    elif impl == "xla":
        logp, ent, outside = from_pieces(
            *logits_xla.pieces(logits.shape, options, tau, softcap, trunc), (logits,), ids,
            return_entropy, truncated=trunc is not None)
    else:
        logp, ent, outside = from_pieces(
            *logits_pallas.pieces(logits.shape, logits.dtype, options, tau, softcap, trunc),
            (logits,), ids, return_entropy, truncated=trunc is not None)
    return results(logp, ent, outside, return_entropy, return_outside)


def token_logps_from_hidden(hidden: Array, lm_head: Array, ids: Array, *,
                            lm_head_layout: str = "hv", bias: Array | None = None,
                            temperature: float = 1.0, logits_dtype: Any = None,
                            logit_softcap: float | None = None, return_entropy: bool = False,
                            impl: str = "auto",
                            options: head_xla.LmHeadBlockSizes | head_pallas.LmHeadPallasOptions
                            | None = None,
                            check_ids: bool = False, top_k: int | None = None,
                            top_p: float | None = None, min_p: float | None = None,
                            return_outside: bool = False) -> Array | tuple[Array, ...]:
    r"""Per-token log-probs of the logits :math:`z = \mathrm{cast}(h W + b)`, never forming
    ``[B, T, V]`` (``xla``, ``pallas``).

    The logits are those of :func:`grpo_kernels.grpo_loss_from_hidden` (float32
    accumulation, rounded once to ``logits_dtype``); the log-probs are
    :func:`token_logps` of them.

    Args:
      hidden: ``[B, T, H]`` hidden states before the head; position ``t`` scores
        ``ids[:, t]``.
      lm_head: ``[H, V]`` (``lm_head_layout="hv"``) or ``[V, H]`` (``"vh"``).
      ids: ``[B, T]`` integer token ids (clamped into ``[0, V)`` unless ``check_ids``).
      lm_head_layout: ``"hv"`` or ``"vh"``, as in :func:`grpo_kernels.grpo_loss_from_hidden`.
      bias: Optional ``[V]`` head bias.
      logits_dtype: Dtype of the logits, as in :func:`grpo_kernels.grpo_loss_from_hidden`.
      temperature: :math:`\tau > 0`.
      logit_softcap: :math:`c > 0`: the logits soft-capped, :math:`c \tanh(z / c)`, after the
        head and before the temperature (Gemma 2's final-logit cap; ``reference`` and ``xla``).
      return_entropy: Also return each position's entropy.
      impl: ``"auto"`` (``xla``), ``"reference"`` (materialised logits), ``"xla"`` (one
        chunked matmul and the softmax statistics) or ``"pallas"`` (TPU kernel).
      options: ``LmHeadBlockSizes`` for ``xla``, ``LmHeadPallasOptions`` for ``pallas``.
      check_ids: Raise ValueError for an id outside ``[0, V)``.
      top_k: Keep the ``top_k`` largest scaled logits of each row (as :func:`token_logps`;
        ``xla`` finds each chunk's floors in its one matmul pass).
      top_p: Then the smallest top set of probability ``>= top_p``.
      min_p: First the tokens of probability ``>= min_p`` times the row's largest.
      return_outside: Also return ``[B, T]`` bool: the chosen token lies outside the kept set.

    Returns:
      ``logp [B, T]`` float32, then ``entropy`` and ``outside`` when asked, as
      :func:`token_logps`; differentiable w.r.t. ``hidden``, ``lm_head`` and ``bias``.

    Raises:
      ValueError: naming the argument.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from grpo_kernels import token_logps, token_logps_from_hidden
      >>> h = jax.random.normal(jax.random.key(0), (2, 3, 8))
      >>> w = jax.random.normal(jax.random.key(1), (8, 40))
      >>> ids = jnp.array([[1, 2, 3], [4, 5, 39]])
      >>> fused = token_logps_from_hidden(h, w, ids, impl="xla")
      >>> bool(jnp.allclose(fused, token_logps(h @ w, ids, impl="reference"), atol=1e-5))
      True
    """
    impl = resolve_impl(impl, options, head_api.OPTION_TYPES, head_api.default_impl)
    fmt = head_api.validate_head(hidden, lm_head, lm_head_layout, bias, logits_dtype,
                                 logit_softcap)
    b, t, _ = hidden.shape
    vocab = fmt.vocab(lm_head)
    trunc = requested_truncation(vocab, top_k, top_p, min_p, return_outside)
    tau = check_temperature(temperature)
    ids = check_token_ids(ids, b, t, vocab, check_ids)
    primals = (hidden, lm_head, bias)
    if impl == "reference":
        z = head_logits(hidden, lm_head, fmt.layout, bias, fmt.logits_dtype)
        logp, ent, outside = truncated_token_logps(z, ids, tau, fmt.softcap, trunc)
    elif impl == "xla":
        logp, ent, outside = from_pieces(
            *head_xla.pieces(hidden, lm_head, fmt, options, tau, vocab, None, trunc=trunc),
            primals, ids, return_entropy, truncated=trunc is not None)
    else:
        logp, ent, outside = from_pieces(
            *head_pallas.pieces(hidden, lm_head, fmt, options, tau, trunc=trunc), primals, ids,
            return_entropy, truncated=trunc is not None)
    return results(logp, ent, outside, return_entropy, return_outside)
