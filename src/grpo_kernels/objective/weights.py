r"""The per-token weights of the loss, :math:`L = \sum_{bt} w_{bt} \ell_{bt}`: TRL's
``loss_type`` normalisations and tunix's ``loss_agg_mode`` aggregations, on rows or on packed
rows' segments."""

from __future__ import annotations

import jax.numpy as jnp

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective.base import Array, BatchSum, _f32, _local, _row_counts
from grpo_kernels.objective.segments import Segments


def token_weights(
    mask: Array,
    config: GRPOLossConfig,
    num_items_in_batch: Array | float | None = None,
    batch_sum: BatchSum = _local,
    segments: Segments | None = None,
) -> Array:
    r"""Per-token weights ``w`` such that the loss is ``sum(w * per_token_loss)``.

    With :math:`n_b = \sum_t m_{bt}`, :math:`N = \sum_b n_b`, ``T`` the mask's length and
    :math:`R = \max(|\{b : n_b > 0\}|, 1)` the non-empty sequences, by ``loss_type`` (TRL):

    - ``grpo``:    :math:`w_{bt} = m_{bt} / (B \max(n_b, 1))`
    - ``bnpo``:    :math:`w_{bt} = m_{bt} / \max(N, 1)`
    - ``dr_grpo``: :math:`w_{bt} = m_{bt} / (B \cdot \text{max\_completion\_length})`
    - ``dapo``:    :math:`w_{bt} = m_{bt} / \text{num\_items\_in\_batch}`
      (default :math:`\max(N, 1)`)
    - ``sapo`` as ``grpo``; ``cispo`` and ``vespo`` as ``dapo``
    - ``luspo``:   :math:`w_{bt} = m_{bt} / B`: TRL 1.16's ``(per_token_loss * mask).sum(-1)
      .mean()``, each sequence's sum over its tokens (for a loss constant along a sequence,
      :math:`n_b \ell_b`: longer sequences weigh more). Liger-Kernel 0.8.5 aggregates
      ``(per_token_loss * mask.sum(-1, keepdim=True)).mean()``, the same when the per-token
      loss is one value per sequence and not otherwise (docs/loss.md)

    or, when ``config.loss_agg_mode`` is set, by tunix's aggregation (replacing the above):

    - ``token-mean``: :math:`m_{bt} / \max(N, 1)`
    - ``sequence-mean-token-mean``: :math:`m_{bt} / (R \max(n_b, 1))`
    - ``sequence-mean-token-scale``: :math:`m_{bt} / (R\,\nu)`, :math:`\nu` =
      ``loss_agg_norm`` or ``T``
    - ``seq-mean-token-sum``: :math:`m_{bt} / R`
    - ``sequence-mean-token-sum-norm``: :math:`m_{bt} / \nu`, :math:`\nu` = ``loss_agg_norm``
      or ``R`` (tunix 0.1.7's default; its development head divides by ``B``, which the tunix
      adapter passes as ``loss_agg_norm``)

    With packed rows (``segments``, :mod:`~grpo_kernels.objective.segments`) tunix's
    aggregations count segments where they count sequences (tunix's
    ``_aggregate_loss_segmented``): with :math:`k` the token's segment, :math:`c` its scored
    tokens, :math:`a` whether it is active and :math:`R_s = \sum a` the active segments,

    - ``token-mean``: as unpacked
    - ``sequence-mean-token-mean``: :math:`m_{bt} a_{bk} / (R_s \max(c_{bk}, 1))`
    - ``sequence-mean-token-scale``: :math:`m_{bt} a_{bk} / (R_s \nu)`, ``loss_agg_norm``
      required (the row's length would dilute every sequence; tunix refuses it too)
    - ``seq-mean-token-sum``: :math:`m_{bt} a_{bk} / R_s`
    - ``sequence-mean-token-sum-norm``: :math:`m_{bt} / \nu`, :math:`\nu` =
      ``loss_agg_norm`` or :math:`R_s`

    (:math:`R` and :math:`R_s` floored at 1, and at :math:`10^{-6}` in the two ``sum``
    modes, as tunix floors them.) Of the TRL loss types only the token-level normalisations
    (``bnpo``, ``dapo``, ``cispo``) take packed rows.

    Args:
      mask: ``[B, T]`` completion mask in {0, 1}.
      config: Loss options; ``loss_type``, ``loss_agg_mode`` and ``max_completion_length``
        are read.
      num_items_in_batch: The ``dapo`` normaliser (of the whole batch); ignored otherwise.
      batch_sum: Local sum -> whole-batch sum (see :data:`BatchSum`); ``B``, ``N``, ``R`` and
        :math:`R_s` above are whole-batch figures.
      segments: The layout of packed rows, or ``None``.

    Returns:
      ``[B, T]`` float32 weights (this device's rows); all zero when the mask is all zero.
    """
    mask = _f32(mask)
    if config.loss_agg_mode is not None:
        if segments is not None:
            return _segment_weights(mask, config, segments, batch_sum)
        return _tunix_weights(mask, config, batch_sum)
    if config.loss_type in ("grpo", "sapo"):
        return mask / (jnp.maximum(_row_counts(mask), 1.0) * batch_sum(_f32(mask.shape[0])))
    if config.loss_type == "luspo":
        return mask / batch_sum(_f32(mask.shape[0]))
    if config.loss_type == "dr_grpo":
        return mask / (batch_sum(_f32(mask.shape[0])) * float(config.max_completion_length))
    if config.loss_type == "bnpo" or num_items_in_batch is None:
        return _token_mean_weights(mask, batch_sum)
    return mask / _f32(num_items_in_batch)


def _token_mean_weights(mask: Array, batch_sum: BatchSum) -> Array:
    r""":math:`m_{bt} / \max(N, 1)` (``bnpo``, tunix's ``token-mean``)."""
    return mask / jnp.maximum(batch_sum(jnp.sum(mask)), 1.0)


# tunix's floor of the norm it divides by (common._check_get_norm's users: jnp.clip(norm, 1e-6)).
_NORM_FLOOR = 1e-6


def _norm(config: GRPOLossConfig, default: Array | float) -> Array | float:
    """tunix's ``norm``: ``config.loss_agg_norm`` when set, else ``default``, floored."""
    norm = default if config.loss_agg_norm is None else float(config.loss_agg_norm)
    return jnp.maximum(norm, _NORM_FLOOR)


def _tunix_weights(mask: Array, config: GRPOLossConfig, batch_sum: BatchSum) -> Array:
    """The weights of tunix's ``loss_agg_mode`` on unpacked rows (see :func:`token_weights`)."""
    mode = config.loss_agg_mode
    if mode == "token-mean":
        return _token_mean_weights(mask, batch_sum)
    counts = _row_counts(mask)
    rows = jnp.maximum(batch_sum(jnp.sum((counts > 0).astype(jnp.float32))), 1.0)
    if mode == "sequence-mean-token-mean":
        return mask / (jnp.maximum(counts, 1.0) * rows)
    if mode == "sequence-mean-token-scale":
        return mask / (rows * _norm(config, float(mask.shape[-1])))
    if mode == "seq-mean-token-sum":
        return mask / rows
    return mask / _norm(config, rows)  # sequence-mean-token-sum-norm


def _segment_weights(mask: Array, config: GRPOLossConfig, segments: Segments,
                     batch_sum: BatchSum) -> Array:
    """The weights of tunix's ``loss_agg_mode`` on packed rows (see :func:`token_weights`)."""
    mode = config.loss_agg_mode
    if mode == "token-mean":
        return _token_mean_weights(mask, batch_sum)
    active = segments.active(mask)
    n_active = batch_sum(jnp.sum(active))
    scored = mask * segments.per_token(active)  # the tokens of active segments
    if mode == "sequence-mean-token-mean":
        counts = jnp.maximum(segments.per_token(segments.counts(mask)), 1.0)
        return scored / (counts * jnp.maximum(n_active, 1.0))
    if mode == "sequence-mean-token-scale":
        if config.loss_agg_norm is None:
            raise ValueError(SCALE_NEEDS_NORM)
        return scored / (_norm(config, 0.0) * jnp.maximum(n_active, 1.0))
    if mode == "seq-mean-token-sum":
        return scored / jnp.maximum(n_active, _NORM_FLOOR)
    return mask / _norm(config, n_active)  # sequence-mean-token-sum-norm


SCALE_NEEDS_NORM = ("loss_agg_mode='sequence-mean-token-scale' with packed rows needs "
                    "config.loss_agg_norm (e.g. the longest completion): the row's length "
                    "would dilute every sequence")
