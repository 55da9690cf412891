r"""The fused XLA head under the batch's entropy quantile: one pass and a small correction.

With ``top_entropy_quantile`` :math:`\rho < 1`, a token's policy term counts only when its
entropy is at or above the :math:`1 - \rho` quantile :math:`q` of the batch's masked entropies
(:func:`~grpo_kernels.objective.factors.entropy_mask`), and the entropy bonus's denominator
counts the selected tokens. No token's gradient is known before every token's entropy is;
waiting for them costs the head a statistics pass, a fourth matmul of the logits' size. Instead,
for a config that is token-separable once the selection is given
(:func:`~grpo_kernels.objective.separable_given_selection`):

1. **Estimate.** :math:`\hat q`, the same quantile of the entropies of :data:`SAMPLE_ROWS` rows
   spread evenly over the batch (a statistics pass over those rows alone), and :math:`\hat n`,
   the denominator of the count :math:`q` selects when the entropies are distinct
   (:func:`~grpo_kernels.objective.factors.distinct_selection_count`).
2. **One pass.** The token-separable sweep of :func:`.xla_sweep.head_sweep`, each token's
   :math:`(g, h)` formed with the selection :math:`\hat e = m\,[H \ge \hat q]` and
   :math:`\hat n` (:func:`~grpo_kernels.objective.selected_row_grad`).
3. **Correction.** With every entropy known, the exact :math:`e` and :math:`n`, and the exact
   :math:`(g, h)` of every token. The tokens whose factors differ from the pass's (entropy
   between :math:`\hat q` and :math:`q`; every selected one if :math:`\hat n \ne n`, with ties
   at the quantile) are visited again, in chunks of only them: their logits once more, their
   ``dh`` rows rewritten from the exact factors, and
   :math:`\partial L/\partial W \mathrel{+}= h^\top \delta(\Delta g, \Delta h)`,
   :math:`\partial L/\partial b \mathrel{+}= \sum \delta(\Delta g, \Delta h)`
   (:math:`\delta` is linear in the factors).

The result is the gradient of the exact selection whatever :math:`\hat q` is; the estimate only
decides how many rows the correction visits: about the rank error of a quantile of
:data:`SAMPLE_ROWS` values, a few percent of the tokens (docs/loss.md has the measured cost).

Under a sampler's truncation every step takes the truncated distribution: the estimate's
entropies are the truncated rows' (their floors found in its statistics pass), the one pass
finds each chunk's floors, and the correction applies the floors that pass found.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.objective import RowGrad, selected_row_grad
from grpo_kernels.objective.factors import (
    distinct_selection_count,
    entropy_mask,
    entropy_norm,
    masked_quantile,
    select_at,
)
from grpo_kernels.objective.base import _local
from grpo_kernels.objective.batch import TokenBatch
from grpo_kernels.ops.core.truncation import Truncation
from grpo_kernels.ops.lm_head_loss.xla_sweep import (
    Head,
    ThenFn,
    _accumulate_dweight,
    _as_bits,
    head_sweep,
    logits_delta,
    rows_of,
    take_rows,
)

Array = jax.Array
_F32 = jnp.float32

# Rows whose entropies estimate the threshold: a 1/16 quantile's rank error is about
# sqrt(rho (1 - rho) / SAMPLE_ROWS), 2.5% of the tokens at rho = 0.2.
SAMPLE_ROWS = 256


@dataclasses.dataclass(frozen=True)
class QuantilePass:
    """The estimate of step 1 and what steps 2 and 3 need (``[N]`` columns of the batch)."""

    columns: dict[str, Array | None]
    config: GRPOLossConfig
    threshold: Array
    norm: Array

    @classmethod
    def estimate(cls, h: Array, ids: Array, head: Head, temperature: float, rows: int,
                 batch: TokenBatch, config: GRPOLossConfig,
                 trunc: Truncation | None = None) -> "QuantilePass":
        """Step 1 on the ``[N, H]`` rows ``h`` and their ``[N]`` ids (the entropies of the
        sampler's truncated distribution under ``trunc``)."""
        columns = batch.token_columns(config)
        mask = columns["mask"]
        n = h.shape[0]
        pick = jnp.asarray(np.arange(min(n, SAMPLE_ROWS)) * n // min(n, SAMPLE_ROWS))
        stats, _ = head_sweep(take_rows(h, pick), ids[pick], head, temperature,
                              min(rows, pick.shape[0]), None, trunc=trunc)
        ent = stats[2]
        threshold, _ = masked_quantile(ent, mask[pick], 1.0 - config.top_entropy_quantile,
                                       _local)
        count = distinct_selection_count(mask, config.top_entropy_quantile)
        norm = entropy_norm(mask, _local, count)
        return cls(columns, config, threshold, norm)

    def grad_fn(self, start: Any, size: int, logp: Array, entropy: Array) -> RowGrad:
        """Step 2's factors of rows ``start .. start + size`` (a ``head_sweep`` grad_fn)."""
        c = {k: rows_of(v, start, size) for k, v in self.columns.items()}
        return selected_row_grad(logp, entropy, select_at(entropy, c["mask"], self.threshold),
                                 self.norm, c, self.config)

    def exact(self, logp: Array, entropy: Array) -> RowGrad:
        """Every token's factors under the batch's own selection (the gradient of
        :func:`~grpo_kernels.objective.grpo_objective`)."""
        mask = self.columns["mask"]
        selected = entropy_mask(entropy, mask, self.config, _local)
        norm = entropy_norm(mask, _local, jnp.sum(mask * selected))
        return selected_row_grad(logp, entropy, selected, norm, self.columns, self.config)

    def rows_to_fix(self, logp: Array, entropy: Array) -> tuple[RowGrad, RowGrad, Array]:
        """``(exact, diff, fix)``: every token's exact factors, their difference from step 2's
        and the ``[N]`` tokens where they differ."""
        exact = self.exact(logp, entropy)
        guess = self.grad_fn(0, logp.shape[0], logp, entropy)
        fix = exact.g != guess.g
        diff = RowGrad(exact.g - guess.g)
        if exact.h is not None:
            fix = fix | (exact.h != guess.h)
            diff = RowGrad(diff.g, exact.h - guess.h, entropy)
        return exact, diff, fix

    def correction(self, h: Array, ids: Array, head: Head, temperature: float, rows: int,
                   dw_rows: int) -> ThenFn:
        """Step 3 as ``head_sweep``'s ``then``, in chunks of ``rows`` corrected tokens (with
        the floors of a truncating pass: its statistics' fourth entry)."""
        def then(stats, grads):
            logp, lse, entropy = stats[:3]
            floor = stats[3] if len(stats) > 3 else None
            exact, diff, fix = self.rows_to_fix(logp, entropy)
            return correct_rows(h, ids, head, temperature, lse, exact, diff, fix, grads,
                                rows, dw_rows, floor)

        return then


def correct_rows(h: Array, ids: Array, head: Head, temperature: float, lse: Array,
                 exact: RowGrad, diff: RowGrad, fix: Array, grads: tuple, rows: int,
                 dw_rows: int, floor: Array | None = None) -> tuple:
    """Step 3 on the gradients of a sweep (``(dh_bits, dW [H, V] or None, db or None)``):
    the rows where ``fix`` is set, ``rows`` at a time, as many chunks as they fill (``floor``:
    the rows' truncation floors, or None)."""
    n = h.shape[0]
    order = jnp.nonzero(fix, size=-(-n // rows) * rows, fill_value=n)[0]
    chunks = (jnp.sum(fix.astype(jnp.int32)) + rows - 1) // rows

    def body(k, carry):
        dh_bits, dw, db = carry
        idx = jax.lax.dynamic_slice_in_dim(order, k * rows, rows)
        safe, valid = jnp.minimum(idx, n - 1), idx < n

        def pick(row: RowGrad) -> RowGrad:
            g, hh, ent = (None if x is None else x[safe] for x in row)
            return RowGrad(jnp.where(valid, g, 0.0),
                           None if hh is None else jnp.where(valid, hh, 0.0), ent)

        hc = take_rows(h, safe)
        s = head.scores(head.logits(hc), temperature)
        idc, lse_c = ids[safe], lse[safe]
        floor_c = None if floor is None else floor[safe]
        full = logits_delta(s, idc, pick(exact).over(temperature), lse_c, head,
                            temperature=temperature, floor=floor_c)
        dh_bits = dh_bits.at[idx].set(_as_bits(head.dhidden(full).astype(h.dtype)),
                                      mode="drop")
        if dw is None and db is None:
            return dh_bits, dw, db
        part = logits_delta(s, idc, pick(diff).over(temperature), lse_c, head,
                            temperature=temperature, floor=floor_c)
        if dw is not None:
            dw = _accumulate_dweight(dw, jax.lax.optimization_barrier(hc.T), part, dw_rows)
        if db is not None:
            db = db + jnp.sum(part.astype(_F32), axis=0)
        return dh_bits, dw, db

    return jax.lax.fori_loop(0, chunks, body, grads)
