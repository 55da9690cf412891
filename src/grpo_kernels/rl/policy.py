r"""Where the model meets the loss: completion log-probs, the micro-batch loss with the whole
batch's normalisers, and the compiled programs of one update.

A batch row is ``[prompt (left-padded to P) | completion (C)]``. The decoder runs on the row but
its last token; the hidden states at positions ``P-1 .. P+C-2`` predict the completion tokens,
and only those ``[N, C, H]`` states reach the head. ``loss.head`` picks the op and ``loss.impl``
its implementation (``auto``, ``reference``, ``xla`` or ``pallas``):

- ``logits``: logits ``[N, C, V]`` from ``model.logits``, then :func:`grpo_kernels.grpo_loss`;
- ``fused``: :func:`grpo_kernels.grpo_loss_from_hidden` on the hidden states and the head in
  the compute dtype, the logits (bf16 operands, float32 accumulation: the numbers of
  ``logits``) formed a chunk at a time, without ``[N, C, V]``.

``loss.logits_dtype`` rounds the logits both heads see: float32 (the default: the
accumulator's numbers) or bfloat16 (what a bf16 model's head gives in tunix or TRL; the
loss's statistics stay float32, and the logits head's ``[N, C, V]`` and its gradient take half
the bytes).

Gradient accumulation follows TRL 1.16 (``GRPOTrainer._compute_loss``), whose accumulation
steps are our micro-batches: an update of ``B`` rows and ``K`` real completion tokens runs
``G = B / M`` micro-batches of ``M`` rows (``train.micro_batch_size`` divides the batch) and
sums their gradients. Per loss type (:func:`micro_config`, :func:`micro_scale`):

- ``grpo``, ``sapo``, ``dr_grpo``, ``luspo`` (per-row normalisers): each micro-batch's loss
  times ``M / B = 1 / G``, TRL's division by the accumulation steps; the sum is the whole
  batch's loss;
- ``dapo``, ``cispo``, ``vespo``: ``num_items_in_batch = K``, each micro-batch's loss
  unscaled, as TRL's ``num_items_in_batch`` spans the generation batch;
- ``bnpo``: the whole batch's token mean, which is ``dapo``'s normaliser with
  ``num_items_in_batch = K``, so its micro-batches run as ``dapo`` (TRL instead takes each
  micro-batch's own token mean over ``G``; the two agree when the micro-batches hold equal
  token counts).

The entropy bonus is TRL's under accumulation: each micro-batch's token mean of the entropy
over ``G``, whatever the loss type (for the ``num_items`` types, and ``bnpo`` run as one of
them, the micro-batch's ``entropy_coef`` is divided by ``G``). ``top_entropy_quantile``'s
quantile is each micro-batch's own, as in TRL.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_kernels.config import NUM_ITEMS_LOSS_TYPES, GRPOLossConfig
from grpo_kernels.objective.metrics import masked_mean
from grpo_kernels.ops.core.inputs import wants_sampler_logps
from grpo_kernels.ops.lm_head_loss import grpo_loss_from_hidden
from grpo_kernels.ops.lm_head_loss.lookup import tied_lookup
from grpo_kernels.ops.logits_loss import grpo_loss
from grpo_kernels.ops.logps import token_logps, token_logps_from_hidden

Array = jax.Array
# outside_truncation: the share of tokens the sampler's truncation would have dropped (0 with
# none); sampler_ratio: the mean of exp(logp - the sampler's logp) over the completion tokens
# (NaN without the sampler's log-probs); token-weighted means as the others.
METRIC_NAMES = ("kl", "entropy", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region",
                "outside_truncation", "sampler_ratio")
LOSS_METRICS = METRIC_NAMES[:5]


@dataclasses.dataclass(frozen=True)
class Batch:
    """One rollout's training rows (host arrays).

    Attributes:
      ids: ``[N, P + C]`` prompt (left-padded) then completion ids.
      attention: ``[N, P + C]`` 1 for real tokens.
      mask: ``[N, C]`` completion mask (1 up to and including the end token).
      advantages: ``[N]``.
      prompt_width: ``P``.
      old_logps, ref_logps: ``[N, C]`` or None.
      sampler_logps: ``[N, C]`` the sampler's log-probs of the completion tokens, or None:
        the metric ``sampler_ratio`` reads them (None: NaN), and the loss where its options
        read them (``sampler_correction``, the off-policy mask: :func:`loss_on`).
    """

    ids: np.ndarray
    attention: np.ndarray
    mask: np.ndarray
    advantages: np.ndarray
    prompt_width: int
    old_logps: np.ndarray | None = None
    ref_logps: np.ndarray | None = None
    sampler_logps: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return int(self.ids.shape[0])

    def micro(self, start: int, size: int) -> dict[str, Any]:
        """Rows ``start .. start+size-1`` as a dict of arrays (None kept for absent inputs)."""
        sl = slice(start, start + size)
        out = {"ids": self.ids[sl], "attention": self.attention[sl], "mask": self.mask[sl],
               "advantages": self.advantages[sl]}
        for name in ("old_logps", "ref_logps", "sampler_logps"):
            value = getattr(self, name)
            out[name] = None if value is None else value[sl]
        return out


def micro_config(config: GRPOLossConfig, micro_batches: int) -> GRPOLossConfig:
    """The loss options each of ``micro_batches`` micro-batches runs with (see the module
    docstring): ``bnpo`` as ``dapo`` over the batch's token count, and for the ``num_items``
    types the entropy bonus's coefficient over the accumulation steps."""
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    if config.loss_agg_mode is not None:
        raise ValueError("micro_config: loss_agg_mode (tunix's aggregation) has no "
                         f"accumulation rule here, got {config.loss_agg_mode!r}")
    if config.loss_type == "bnpo":
        config = dataclasses.replace(config, loss_type="dapo")
    if config.loss_type in NUM_ITEMS_LOSS_TYPES and config.has_entropy_bonus:
        config = dataclasses.replace(config, entropy_coef=config.entropy_coef / micro_batches)
    return config


def micro_scale(config: GRPOLossConfig, rows: int, total_rows: int) -> float:
    """Weight of a micro-batch's loss (under :func:`micro_config`'s options) in the update's:
    ``rows / total_rows`` for the per-row normalisers, else 1 (``num_items_in_batch`` spans
    the batch)."""
    if config.loss_type in ("grpo", "dr_grpo", "sapo", "luspo"):
        return rows / total_rows
    return 1.0


def completion_hidden(model: Any, ids: Array, attention: Array, prompt_width: int,
                      embeddings: Array | None = None) -> Array:
    """Hidden states ``[N, C, H]`` that predict the completion tokens ``ids[:, P:]``
    (``embeddings``: the rows of ``ids[:, :-1]``, when the caller looked them up)."""
    hidden = model(ids[:, :-1], attention_mask=attention[:, :-1], return_hidden=True,
                   embeddings=embeddings)
    return hidden[:, prompt_width - 1:]


def _fused_inputs(model: Any, mb: dict[str, Any], prompt_width: int) -> tuple[Array, Array]:
    """``(hidden, head weights)`` for the fused loss. A tied head's table goes through
    :func:`~grpo_kernels.ops.lm_head_loss.lookup.tied_lookup` with the input lookup, so the
    lookup's gradient is added into the head's in place (a 16-bit table: no float32 copy of
    it on XLA:CPU)."""
    rows, table = None, model.head()
    if model.config.tie_word_embeddings:
        rows, table = tied_lookup(table, mb["ids"][:, :-1])
    hidden = completion_hidden(model, mb["ids"], mb["attention"], prompt_width, rows)
    return hidden, table.astype(model.config.compute_dtype)


def loss_on(model: Any, mb: dict[str, Any], *, head: str, impl: str, config: GRPOLossConfig,
            prompt_width: int, num_items: Array | None = None, mesh: Any = None,
            sharding: Any = None, options: Any = None, logits_dtype: Any = jnp.float32,
            ) -> tuple[Array, dict[str, Array]]:
    """The GRPO loss of a micro-batch (the micro-batch's own normalisers) and its metrics;
    ``options``: the implementation's options (:func:`grpo_kernels.rl.kernel.resolve`);
    ``logits_dtype``: the dtype the logits are rounded to before the loss."""
    targets = mb["ids"][:, prompt_width:]
    sampler = mb.get("sampler_logps") if wants_sampler_logps(config) else None
    extra = dict(config=config, old_logps=mb["old_logps"], ref_logps=mb["ref_logps"],
                 sampler_logps=sampler, num_items_in_batch=num_items, options=options)
    if mesh is not None:
        from grpo_kernels.sharding import sharded_grpo_loss, sharded_grpo_loss_from_hidden

        extra.update(mesh=mesh, sharding=sharding)
        fused, plain = sharded_grpo_loss_from_hidden, sharded_grpo_loss
    else:
        fused, plain = grpo_loss_from_hidden, grpo_loss
    if head == "fused":
        hidden, weights = _fused_inputs(model, mb, prompt_width)
        return fused(hidden, weights, targets, mb["mask"], mb["advantages"], impl=impl,
                     lm_head_layout="vh", logits_dtype=logits_dtype, **extra)
    hidden = completion_hidden(model, mb["ids"], mb["attention"], prompt_width)
    return plain(model.logits(hidden, logits_dtype), targets, mb["mask"], mb["advantages"],
                 impl=impl, **extra)


def make_programs(graphdef: Any, *, head: str, impl: str, config: GRPOLossConfig,
                  prompt_width: int, mesh: Any = None, sharding: Any = None,
                  options: Any = None, logits_dtype: Any = jnp.float32,
                  ) -> tuple[Callable, Callable]:
    """``(grad_fn, logp_fn)`` for one prompt width, to be jitted (the arguments:
    :func:`loss_on`'s).

    ``grad_fn(state, mb, scale, num_items)`` returns ``((scale * loss, metrics), grads)``;
    ``logp_fn(state, mb)`` the completion log-probs ``[M, C]`` (no gradient), by the
    forward-only op (:func:`completion_logps`).
    """
    def scaled_loss(state, mb, scale, num_items):
        model = nnx.merge(graphdef, state)
        loss, metrics = loss_on(model, mb, head=head, impl=impl, config=config,
                                prompt_width=prompt_width, num_items=num_items, mesh=mesh,
                                sharding=sharding, options=options,
                                logits_dtype=logits_dtype)
        tokens = jnp.maximum(jnp.sum(mb["mask"].astype(jnp.float32)), 1.0)
        keep = {name: metrics[name] for name in LOSS_METRICS}
        keep["outside_truncation"] = metrics.get("outside_truncation", 0.0) / tokens
        keep["sampler_ratio"] = sampler_ratio(metrics.get("logp"), mb.get("sampler_logps"),
                                              mb["mask"])
        return scale * loss, keep

    grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)

    def logp_fn(state, mb):
        model = nnx.merge(graphdef, state)
        return jax.lax.stop_gradient(completion_logps(
            model, mb, head=head, impl=impl, prompt_width=prompt_width,
            temperature=config.temperature, mesh=mesh, sharding=sharding, options=options,
            logits_dtype=logits_dtype, top_k=config.top_k, top_p=config.top_p,
            min_p=config.min_p))

    return grad_fn, logp_fn


def sampler_ratio(logp: Array | None, sampler_logps: Array | None, mask: Array) -> Array:
    r"""The mean importance ratio against the sampler over the completion tokens,
    :math:`\sum_{bt} m_{bt} e^{\log\pi_{bt} - \log\pi^{s}_{bt}} / \sum_{bt} m_{bt}` (NaN
    without the sampler's log-probs, or from a loss that reports no ``logp``). In the first
    epoch of a step the policy is the sampler's, so this is 1 up to the two programs' numerics
    and what the two log-probs describe (the sampler's truncation)."""
    if logp is None or sampler_logps is None:
        return jnp.float32(jnp.nan)
    ratio = jnp.exp(logp.astype(jnp.float32) - sampler_logps.astype(jnp.float32))
    return masked_mean(jnp.where(mask > 0, ratio, 0.0), mask)  # padding's ratio may be inf


def completion_logps(model: Any, mb: dict[str, Any], *, head: str, impl: str,
                     prompt_width: int, temperature: float, mesh: Any = None,
                     sharding: Any = None, options: Any = None,
                     logits_dtype: Any = jnp.float32, top_k: int | None = None,
                     top_p: float | None = None, min_p: float | None = None) -> Array:
    """The completion tokens' log-probs ``[M, C]`` under ``model`` (the reference and
    old-policy passes), by the forward-only op of the same head and implementation as the
    loss: :func:`grpo_kernels.token_logps_from_hidden` for ``fused`` (no ``[M, C, V]``),
    :func:`grpo_kernels.token_logps` of ``model.logits`` for ``logits``; on a mesh their
    sharded versions. The same numbers as the loss's ``logp`` metric: under the sampler's
    truncation ``top_k`` / ``top_p`` / ``min_p`` when given (on a mesh, one that keeps rows
    whole: :mod:`grpo_kernels.sharding.truncation`)."""
    targets = mb["ids"][:, prompt_width:]
    extra = dict(top_k=top_k, top_p=top_p, min_p=min_p)
    if mesh is not None:
        extra.update(mesh=mesh, sharding=sharding)
    if head == "fused":
        from grpo_kernels.sharding import sharded_token_logps_from_hidden

        hidden, weights = _fused_inputs(model, mb, prompt_width)
        fn = token_logps_from_hidden if mesh is None else sharded_token_logps_from_hidden
        return fn(hidden, weights, targets, lm_head_layout="vh", logits_dtype=logits_dtype,
                  temperature=temperature, impl=impl, options=options, **extra)
    from grpo_kernels.sharding import sharded_token_logps

    hidden = completion_hidden(model, mb["ids"], mb["attention"], prompt_width)
    fn = token_logps if mesh is None else sharded_token_logps
    return fn(model.logits(hidden, logits_dtype), targets, temperature=temperature, impl=impl,
              options=options, **extra)
