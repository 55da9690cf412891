"""``grpo_loss``: argument checks and the choice of implementation."""

from __future__ import annotations

from typing import Callable

import jax

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective.segments import Segments
from grpo_kernels.objective.batch import TokenBatch
from grpo_kernels.ops.core.validate import (
    backend_kind,
    check_ids_in_range,
    check_softcap,
    resolve_impl,
    validate_token_inputs,
)
from grpo_kernels.ops.logits_loss.pallas import PallasOptions, pallas_grpo_loss
from grpo_kernels.ops.logits_loss.reference import reference_grpo_loss
from grpo_kernels.ops.logits_loss.xla import XlaBlockSizes, xla_grpo_loss

Array = jax.Array

# Every implementation: fn(logits, batch: TokenBatch, config, options) -> (loss, metrics).
IMPLEMENTATIONS: dict[str, Callable[..., tuple[Array, dict[str, Array]]]] = {
    "reference": reference_grpo_loss,
    "xla": xla_grpo_loss,
    "pallas": pallas_grpo_loss,
}
IMPL_CHOICES: tuple[str, ...] = ("auto", *IMPLEMENTATIONS)
OPTION_TYPES: dict[str, type] = {"xla": XlaBlockSizes, "pallas": PallasOptions}

# impl="auto" per backend: only choices a measured benchmark on that backend backs (the
# figures are in docs/benchmarks.md, "The logits loss on an H100"; docs/kernels.md says how to
# add a row). Backends not listed use xla.
MEASURED_DEFAULTS: dict[str, str] = {"gpu": "pallas"}


def default_impl(backend: str | None = None) -> str:
    """The implementation ``impl="auto"`` resolves to on ``backend`` (default: JAX's).

    :data:`MEASURED_DEFAULTS` where a benchmark on that backend measured a winner, else
    ``xla``, which beats ``reference`` in time and memory everywhere it was measured (CPU and
    GPU). TPU has no measurement yet; ``pallas`` runs only interpreted on CPU.
    """
    return MEASURED_DEFAULTS.get(backend_kind(backend), "xla")


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
    sampler_weights: Array | None = None,
    sampler_logps: Array | None = None,
    segments: Segments | None = None,
    impl: str = "auto",
    check_ids: bool = False,
    options: XlaBlockSizes | PallasOptions | None = None,
    logit_softcap: float | None = None,
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
    sum over ``B * max_completion_length``; ``dapo``: sum over ``num_items_in_batch``), or
    tunix's ``loss_agg_mode`` ones. The config's further options (KL estimators and clamp, dual
    clip, log-ratio clamps, GSPO-token) are written out in :mod:`grpo_kernels.objective`.

    Args:
      logits: ``[B, T, V]`` bfloat16 or float32; position ``t`` predicts ``ids[:, t]``.
      ids: ``[B, T]`` integer token ids. Ids outside ``[0, V)`` are clamped into range unless
        ``check_ids`` is set; positions with ``mask == 0`` are never checked.
      mask: ``[B, T]`` completion mask in {0, 1} (any numeric or bool dtype).
      advantages: ``[B]`` advantages, or ``[B, T]`` (one per token, as packed rows carry them).
      config: Loss options.
      old_logps: ``[B, T]`` sampling-policy log-probs; ``None``: on-policy.
      ref_logps: ``[B, T]`` reference log-probs; required when ``config.beta > 0``.
      num_items_in_batch: ``dapo`` normaliser (default: the number of unmasked tokens).
      sampler_weights: Optional ``[B, T]`` per-token weights of the policy term (not of the
        KL term), e.g. truncated importance weights between the sampler and the trainer
        (tunix's ``sampler_is_weights``); no gradient flows into them.
      sampler_logps: Optional ``[B, T]`` log-probs of the sampler (e.g. vLLM's); required by
        ``config.sampler_correction``, and used by the off-policy mask when given.
      segments: Packed rows: :class:`grpo_kernels.Segments` (``[B, T]`` segment ids, 0 for
        padding, and their static bound), and every sequence-level quantity (the sequence
        ratio, per-sequence means) is taken per segment
        (:func:`grpo_kernels.objective.token_weights` says which options take them);
        ``None``: one sequence per row.
      impl: ``"auto"``, ``"reference"``, ``"xla"`` or ``"pallas"`` (TPU/GPU kernels; interpret
        mode on CPU, for tests only).
      check_ids: Raise ValueError when an unmasked id is outside ``[0, V)`` (at call time for
        concrete inputs, at run time under ``jit``).
      options: The implementation's options: ``XlaBlockSizes`` for ``impl="xla"``,
        ``PallasOptions`` for ``impl="pallas"``, ``None`` for defaults.
      logit_softcap: :math:`c > 0`: the loss sees :math:`c \tanh(z / c)` (Gemma 2's
        final-logit soft cap) before the temperature, with its gradient; ``None``: no cap.
        ``reference`` and ``xla`` only.

    Returns:
      ``(loss, metrics)``: the float32 scalar loss, differentiable w.r.t. ``logits`` (gradient in
      the logits dtype), and metrics without gradient: ``logp`` and ``token_entropy``
      ``[B, T]``, ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_region``, ``kl`` (0
      without ``ref_logps``), ``entropy``, ``policy_loss`` and ``kl_loss`` (the loss is
      ``policy_loss + beta * kl_loss``, minus the entropy bonus with ``entropy_coef``).

    Raises:
      ValueError: at trace time, naming the argument and the expected shape or value.

    Example:
      On policy (no ``old_logps``) every ratio is 1, so the ``grpo`` loss is minus the mean
      advantage, and every implementation agrees with the reference:

      >>> import jax, jax.numpy as jnp
      >>> from grpo_kernels import GRPOLossConfig, grpo_loss
      >>> z = jax.random.normal(jax.random.key(0), (2, 5, 64))
      >>> ids = jax.random.randint(jax.random.key(1), (2, 5), 0, 64)
      >>> mask, adv = jnp.ones((2, 5)), jnp.array([1.5, 0.5])
      >>> loss, metrics = grpo_loss(z, ids, mask, adv, config=GRPOLossConfig(), impl="xla")
      >>> round(float(loss), 6)
      -1.0
      >>> ref, _ = grpo_loss(z, ids, mask, adv, config=GRPOLossConfig(), impl="reference")
      >>> bool(jnp.allclose(loss, ref)), metrics["logp"].shape
      (True, (2, 5))
    """
    validate_token_inputs(logits, ids, mask, advantages, config, old_logps, ref_logps,
                          sampler_weights, sampler_logps, segments)
    impl = resolve_impl(impl, options, OPTION_TYPES, default_impl)
    softcap = check_softcap(logit_softcap)
    if check_ids:
        check_ids_in_range(ids, mask, logits.shape[-1])
    batch = TokenBatch.of(ids, mask, advantages, old_logps, ref_logps, num_items_in_batch,
                          sampler_weights, sampler_logps, segments)
    return IMPLEMENTATIONS[impl](logits, batch, config, options, softcap=softcap)
