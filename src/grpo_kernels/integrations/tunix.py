r"""Our losses as tunix policy losses: ``GRPOConfig(policy_loss_fn="grpo_kernels_fused")``.

Importing this module registers two policy losses in tunix's registry
(``tunix.rl.function_registry.register_policy_loss_fn``), both with tunix's call
``(model, train_example, algo_config, pad_id, eos_id)``:

- ``"grpo_kernels"``: the completion's logits through :func:`grpo_kernels.grpo_loss`
  (``impl="auto"``). From a tunix Qwen2, Qwen3, Llama3, Gemma3 or Gemma they are formed from
  its hidden states and head, in the model's dtype and at the completion's positions only;
  from any other model, by its ``__call__`` (:func:`logits_policy_loss`);
- ``"grpo_kernels_fused"``: the model's final hidden states and head weights through
  :func:`grpo_kernels.grpo_loss_from_hidden`, so the actor update holds no ``[B, T, V]`` array.

:mod:`grpo_kernels.integrations.tunix_modules` reads tunix's model classes below their
logits (qwix LoRA adapters included) and says which models it cannot read.

Both compute tunix's ``grpo_loss_fn`` (tunix/rl/algo_core.py) on the same inputs: the mapping
of its ``GRPOConfig`` is :func:`loss_config`, the aux dict it logs is :func:`tunix_aux`, and
docs/integrations/tunix.md lists every difference. tunix is imported lazily by the functions
that need it (``pip install grpo-kernels[tunix]``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.integrations.tunix_modules import (Head, call_model, completion_hidden,
                                                     completion_logits, head_blocker,
                                                     head_vocab)
from grpo_kernels.objective import log_importance_ratio, token_terms, token_weights
from grpo_kernels.ops.lm_head_loss.api import default_impl as default_head_impl
from grpo_kernels.ops.lm_head_loss.api import grpo_loss_from_hidden
from grpo_kernels.ops.lm_head_loss.xla import LmHeadBlockSizes
from grpo_kernels.ops.logits_loss.api import default_impl as default_logits_impl
from grpo_kernels.ops.logits_loss.api import grpo_loss
from grpo_kernels.ops.logits_loss.pallas import PallasOptions
from grpo_kernels.ops.logps.api import token_logps_from_hidden
from grpo_kernels.sharding import (ShardingSpec, sharded_grpo_loss,
                                   sharded_grpo_loss_from_hidden,
                                   sharded_token_logps_from_hidden)

Array = jax.Array

POLICY_LOSSES: tuple[str, ...] = ("grpo_kernels", "grpo_kernels_fused")
# Where the logits-level loss takes its logits from (logits_policy_loss).
LOGITS_FROM: tuple[str, ...] = ("auto", "model")
# tunix's kl_loss_mode -> our kl_estimator (tunix/rl/common.py: compute_kl_divergence).
KL_MODES: dict[str, str] = {"kl": "k1", "mse_kl": "k2", "low_var_kl": "k3"}
LOSS_ALGOS: tuple[str, ...] = ("grpo", "gspo-token")
# The constants of tunix's grpo_loss_fn: the per-token log-ratio clamp and gspo-token's cap.
TUNIX_LOG_RATIO_CLAMP = 20.0
TUNIX_GSPO_TOKEN_MAX = 10.0


def _field(algo_config: Any, name: str, default: Any = None) -> Any:
    return getattr(algo_config, name, default)


def loss_config(algo_config: Any, has_ref: bool) -> GRPOLossConfig:
    """Our :class:`GRPOLossConfig` for a tunix ``GRPOConfig`` (any object with its fields).

    Read: ``epsilon``, ``epsilon_high`` (absent or ``None``: ``epsilon``), ``epsilon_c`` (the
    dual clip), ``beta`` (applied only with reference log-probs, as tunix), ``kl_loss_mode``,
    ``kl_clamp_value``, ``loss_agg_mode``, ``loss_algo`` and ``temperature`` (0 and 1 leave the
    logits alone, as tunix). The log-ratio clamp (20) and gspo-token's cap (10) are tunix's.

    Raises:
      ValueError: naming the ``GRPOConfig`` field whose value we do not support.
    """
    epsilon = _field(algo_config, "epsilon", 0.2)
    epsilon_high = _field(algo_config, "epsilon_high")
    epsilon_c = _field(algo_config, "epsilon_c")
    beta = _field(algo_config, "beta", 0.0) or 0.0
    kl_mode = _field(algo_config, "kl_loss_mode", "kl")
    loss_algo = _field(algo_config, "loss_algo", "grpo")
    temperature = _field(algo_config, "temperature", 1.0)
    if kl_mode not in KL_MODES:
        raise ValueError(f"GRPOConfig.kl_loss_mode must be one of {tuple(KL_MODES)}, "
                         f"got {kl_mode!r}")
    if loss_algo not in LOSS_ALGOS:
        raise ValueError(f"GRPOConfig.loss_algo must be one of {LOSS_ALGOS}, got {loss_algo!r}")
    if epsilon_c is not None and not epsilon_c > 1:
        raise ValueError(f"GRPOConfig.epsilon_c (the dual clip) must be None or > 1 for "
                         f"grpo_kernels, got {epsilon_c!r}")
    if beta < 0:
        raise ValueError(f"GRPOConfig.beta must be >= 0 for grpo_kernels, got {beta!r}")
    fields = dict(
        epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        beta=float(beta) if has_ref else 0.0,
        temperature=1.0 if temperature in (0, 0.0, None) else temperature,
        importance_sampling_level="token" if loss_algo == "grpo" else "sequence_token",
        loss_agg_mode=_field(algo_config, "loss_agg_mode", "sequence-mean-token-mean"),
        kl_estimator=KL_MODES[kl_mode],
        kl_clamp=_field(algo_config, "kl_clamp_value"),
        dual_clip=epsilon_c,
        log_ratio_clamp=TUNIX_LOG_RATIO_CLAMP,
        sequence_log_ratio_max=None if loss_algo == "grpo" else TUNIX_GSPO_TOKEN_MAX,
    )
    try:
        return GRPOLossConfig(**fields)
    except ValueError as e:  # name the tunix field behind ours
        names = {"epsilon_low": "epsilon", "kl_clamp": "kl_clamp_value",
                 "loss_agg_mode": "loss_agg_mode", "epsilon_high": "epsilon_high",
                 "temperature": "temperature"}
        for ours, theirs in names.items():
            if str(e).startswith(ours):
                raise ValueError(f"GRPOConfig.{theirs}: {e}") from None
        raise


class Example(NamedTuple):
    """The per-token inputs of a tunix ``TrainExample`` as our loss takes them."""

    ids: Array
    mask: Array
    advantages: Array
    old_logps: Array | None
    ref_logps: Array | None
    sampler_weights: Array | None


def example_inputs(train_example: Any) -> Example:
    """Checks a ``TrainExample`` and returns its per-token inputs.

    Raises:
      ValueError: for packed sequences (``segment_ids``) and per-token advantages, which the
        loss does not take, naming the field.
    """
    if _field(train_example, "segment_ids") is not None:
        raise ValueError("train_example.segment_ids is set (packed sequences): grpo_kernels "
                         "supports unpacked examples only")
    advantages = train_example.advantages
    if advantages.ndim != 1:
        raise ValueError(f"train_example.advantages must be [B] (one per completion) for "
                         f"grpo_kernels, got shape {tuple(advantages.shape)}")
    return Example(train_example.completion_ids, train_example.completion_mask,
                   advantages.astype(jnp.float32), train_example.old_per_token_logps,
                   train_example.ref_per_token_logps,
                   _field(train_example, "sampler_is_weights"))


def _accepts_segment_ids(model: Any) -> bool:
    """tunix's rule (common.compute_per_token_logps): segment ids go to models whose
    ``__call__`` takes them."""
    try:
        params = inspect.signature(type(model).__call__).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return "segment_ids" in params or any(
        p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())


def model_inputs(model: Any, train_example: Any, pad_id: int, eos_id: int) -> dict[str, Any]:
    """The model's arguments for a ``TrainExample``'s prompt + completion
    (:func:`token_inputs`)."""
    return token_inputs(model, train_example.prompt_ids, train_example.completion_ids, pad_id,
                        eos_id)


def token_inputs(model: Any, prompt_ids: Array, completion_ids: Array, pad_id: int,
                 eos_id: int) -> dict[str, Any]:
    """The model's arguments for prompt + completion, made by tunix's own ``process_ids``
    (segment ids only for a model whose ``__call__`` takes them, as tunix passes them)."""
    from tunix.rl import common

    tokens, positions, attn_mask, seg_ids = common.process_ids(prompt_ids, completion_ids,
                                                               pad_id, eos_id)
    out = {"input_tokens": tokens, "positions": positions, "attention_mask": attn_mask}
    if _accepts_segment_ids(model) and seg_ids is not None:
        out["segment_ids"] = seg_ids
    return out


# --- the two policy losses ------------------------------------------------------------------------

def _tunix_mean(x: Array, mask: Array) -> Array:
    """tunix's ``masked_mean``: ``sum(x m) / (sum(m) + 1e-8)``."""
    mask = mask.astype(jnp.float32)
    return jnp.sum(x.astype(jnp.float32) * mask) / (jnp.sum(mask) + 1e-8)


def tunix_aux(metrics: dict[str, Array], ex: Example, config: GRPOLossConfig,
              epsilon_c: float | None) -> dict[str, Array]:
    """The aux dict of tunix's ``grpo_loss_fn`` (same keys, same definitions) from our metrics,
    plus ours under ``grpo_kernels/...``. No gradient flows through any of it."""
    sg = jax.lax.stop_gradient
    logp = sg(metrics["logp"])
    mask = ex.mask.astype(jnp.float32)
    old = logp if ex.old_logps is None else ex.old_logps.astype(jnp.float32)
    adv = ex.advantages[:, None]
    ratio_log = log_importance_ratio(logp, old, mask, config)
    terms = token_terms(logp, ratio_log, adv, config)
    ratio, pg1, pg2 = terms["coef_1"], -adv * terms["coef_1"], -adv * terms["coef_2"]
    unclipped_loss = jnp.maximum(pg1, pg2)
    weights = token_weights(mask, config)  # tunix's aggregate_loss with loss_agg_mode
    lower = jnp.zeros_like(ratio) if epsilon_c is None else (
        (unclipped_loss > -epsilon_c * adv) & (adv < 0)).astype(jnp.float32)
    adv_b = jnp.broadcast_to(adv, mask.shape)
    on = mask > 0
    aux = {
        "kl": metrics["kl"],
        "kl_loss": metrics["kl_loss"],
        "pg_loss": metrics["policy_loss"],
        "pg_clipfrac": _tunix_mean((pg2 > pg1).astype(jnp.float32), mask),
        "ppo_kl": _tunix_mean(old - logp, mask),
        "pg_clipfrac_lower": jnp.sum(weights * lower),
        "is_ratio/mean": _tunix_mean(ratio, mask),
        "is_ratio/max": jnp.max(jnp.where(on, ratio, 0.0)),
        "is_ratio/min": jnp.min(jnp.where(on, ratio, jnp.inf)),
        "log_ratio/abs_mean": _tunix_mean(jnp.abs(ratio_log), mask),
        "pg_loss/unclipped_mean": _tunix_mean(pg1, mask),
        "pg_loss/clipped_mean": _tunix_mean(pg2, mask),
        "advantage/abs_mean": _tunix_mean(jnp.abs(adv_b), mask),
        "advantage/max": jnp.max(jnp.where(on, adv_b, -jnp.inf)),
        "advantage/min": jnp.min(jnp.where(on, adv_b, jnp.inf)),
        "advantage/nonzero_frac": _tunix_mean((jnp.abs(adv_b) > 1e-8).astype(jnp.float32), mask),
        "entropy": jnp.sum(weights * sg(metrics["token_entropy"])),
    }
    if ex.sampler_weights is None:
        aux["sampler_is/weight_mean"] = jnp.float32(1.0)
        aux["sampler_is/weight_min"] = jnp.float32(1.0)
    else:
        sis = ex.sampler_weights.astype(jnp.float32)
        aux["sampler_is/weight_mean"] = _tunix_mean(sis, mask)
        aux["sampler_is/weight_min"] = jnp.min(jnp.where(on, sis, jnp.inf))
    for key in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "entropy"):
        aux[f"grpo_kernels/{key}"] = metrics[key]
    return aux


def _loss_kwargs(ex: Example) -> dict[str, Any]:
    return dict(old_logps=ex.old_logps, ref_logps=ex.ref_logps,
                sampler_weights=ex.sampler_weights)


def context_mesh() -> Any:
    """The mesh tunix runs under: the one its ``RLCluster`` enters (``with mesh:``), which its
    models' own ``shard`` reads too, else one set by ``jax.set_mesh`` (under ``jit``, its
    abstract mesh); None without one."""
    from jax.interpreters import pxla

    mesh = pxla.thread_resources.env.physical_mesh
    if not mesh.empty:
        return mesh
    try:  # outside jit: the concrete mesh of jax.set_mesh
        mesh = jax.sharding.get_mesh()
    except (AttributeError, ValueError):  # under jit: its abstract mesh (shard_map takes it)
        mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or getattr(mesh, "empty", True) else mesh


def _mesh_axes(entry: Any, mesh: Any) -> tuple[str, ...]:
    """The axes of ``mesh`` (of size > 1) that one entry of a tunix sharding names."""
    names = entry if isinstance(entry, (tuple, list)) else (entry,)
    return tuple(n for n in names if isinstance(n, str) and n in mesh.shape
                 and mesh.shape[n] > 1)


def placement(model: Any, batch: int, vocab: int,
              head: Head | None = None) -> tuple[Any, ShardingSpec] | None:
    """``(mesh, ShardingSpec)`` for our sharded ops when ``model`` runs on a mesh, else None.

    The axes are the model's own (``model.config.shd_config``, tunix's ``ShardingConfig``):
    the batch over the axes of ``act_btd``'s first entry (tunix's default: ``fsdp``), the
    vocabulary over ``emb_vd``'s first (``tp``), on the mesh in context
    (:func:`context_mesh`). An axis whose size does not divide ``batch`` or ``vocab`` is left
    out (that dimension whole on each device); with neither left, None: the one-device op,
    partitioned by XLA. Given the ``head``, the batch axes that also split its ``H`` where
    tunix places it (``emb_vd``'s second entry for a tied table, ``emb_dv``'s first for an
    ``lm_head``; ``fsdp``) become ``head_axes``: the xla head then gathers its weights block by
    block instead of whole.
    """
    mesh = context_mesh()
    shd = getattr(getattr(model, "config", None), "shd_config", None)
    if mesh is None or mesh.size == 1 or shd is None:
        return None
    batch_axes = _mesh_axes(shd.act_btd[0], mesh)
    vocab_axes = _mesh_axes(shd.emb_vd[0], mesh)
    if batch % math.prod(mesh.shape[a] for a in batch_axes):
        batch_axes = ()
    vocab_axis = vocab_axes[0] if len(vocab_axes) == 1 and vocab_axes[0] not in batch_axes \
        and vocab % mesh.shape[vocab_axes[0]] == 0 else None
    if not batch_axes and vocab_axis is None:
        return None
    return mesh, ShardingSpec(batch_axes, vocab_axis, _head_axes(shd, head, mesh, batch_axes))


def _head_axes(shd: Any, head: Head | None, mesh: Any,
               batch_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The batch axes over which tunix splits the head's ``H`` (see :func:`placement`), when
    they divide it; else ``()``."""
    if head is None:
        return ()
    entry = shd.emb_vd[1] if head.layout == "vh" else getattr(shd, "emb_dv", (None,))[0]
    axes = tuple(a for a in _mesh_axes(entry, mesh) if a in batch_axes)
    hidden = head.weights.shape[1 if head.layout == "vh" else 0]
    return axes if axes and hidden % math.prod(mesh.shape[a] for a in axes) == 0 else ()


def _check_logits_from(logits_from: str) -> None:
    if logits_from not in LOGITS_FROM:
        raise ValueError(f"logits_from: must be one of {list(LOGITS_FROM)}, got {logits_from!r}")


def logits_policy_loss(model: Any, train_example: Any, algo_config: Any, pad_id: int,
                       eos_id: int, impl: str = "auto", options: Any = None,
                       logits_from: str = "auto", **kwargs: Any
                       ) -> tuple[Array, dict[str, Array]]:
    """tunix's GRPO loss through :func:`grpo_kernels.grpo_loss` on the completion's logits,
    with ``impl`` and ``options`` as there (other keyword arguments of tunix's call are
    ignored).

    ``logits_from="auto"`` forms the logits from the model's hidden states and head where
    :func:`~grpo_kernels.integrations.tunix_modules.head_blocker` allows it
    (:func:`~grpo_kernels.integrations.tunix_modules.completion_logits`: the completion's
    positions only, in the model's dtype, without tunix's float32 copy), else calls the model;
    ``"model"`` always calls it. Both give the same numbers.
    """
    _check_logits_from(logits_from)
    ex = example_inputs(train_example)
    config = loss_config(algo_config, ex.ref_logps is not None)
    inputs = model_inputs(model, train_example, pad_id, eos_id)
    t = ex.ids.shape[1]
    if logits_from == "auto" and head_blocker(model) is None:
        logits = completion_logits(model, inputs, t)
    else:
        logits = call_model(model, inputs)[0][:, -t - 1:-1, :]
    where = placement(model, *logits.shape[::2])
    loss_fn = grpo_loss if where is None else functools.partial(
        sharded_grpo_loss, mesh=where[0], sharding=where[1])
    loss, metrics = loss_fn(logits, ex.ids, ex.mask, ex.advantages, config=config,
                            impl=impl, options=logits_options(impl, options),
                            **_loss_kwargs(ex))
    return loss, tunix_aux(metrics, ex, config, _field(algo_config, "epsilon_c"))


def fused_policy_loss(model: Any, train_example: Any, algo_config: Any, pad_id: int,
                      eos_id: int, impl: str = "auto", options: Any = None,
                      **kwargs: Any) -> tuple[Array, dict[str, Array]]:
    """tunix's GRPO loss through :func:`grpo_kernels.grpo_loss_from_hidden`: no ``[B, T, V]``
    array. ``impl`` and ``options`` as there (other keyword arguments are ignored). A model
    that cannot be read below its logits
    (:func:`~grpo_kernels.integrations.tunix_modules.head_blocker`) raises ValueError."""
    blocker = head_blocker(model)
    if blocker is not None:  # before any work
        raise ValueError(f"grpo_kernels_fused needs a model's hidden states and head weights: "
                         f"{blocker} (use policy_loss_fn='grpo_kernels' for it)")
    ex = example_inputs(train_example)
    config = loss_config(algo_config, ex.ref_logps is not None)
    t = ex.ids.shape[1]
    hidden, head = completion_hidden(model, model_inputs(model, train_example, pad_id, eos_id), t)
    where = placement(model, hidden.shape[0], head_vocab(head), head)
    loss_fn = grpo_loss_from_hidden if where is None else functools.partial(
        sharded_grpo_loss_from_hidden, mesh=where[0], sharding=where[1])
    loss, metrics = loss_fn(
        hidden, head.weights, ex.ids, ex.mask, ex.advantages, config=config,
        impl=impl, options=fused_options(impl, options), lm_head_layout=head.layout,
        logits_dtype=head.dtype, logit_softcap=head.softcap, **_loss_kwargs(ex))
    return loss, tunix_aux(metrics, ex, config, _field(algo_config, "epsilon_c"))


def logits_options(impl: str, options: Any) -> Any:
    """The logits-level loss's options: ``options`` when given; else, where the Pallas
    implementation runs, ``PallasOptions(alias_logits=True)``.

    The completion's logits are an intermediate that nothing reads after the loss, so the
    kernels may write the gradient over them: compiled for a v6e, one tunix update of a
    Qwen2.5-1.5B-shaped layer plans 1.81 GB less (docs/integrations/tunix.md, "Both losses on
    a TPU").
    """
    if options is not None:
        return options
    chosen = default_logits_impl() if impl == "auto" else impl
    return PallasOptions(alias_logits=True) if chosen == "pallas" else None


def fused_options(impl: str, options: Any) -> Any:
    """The fused loss's options: ``options`` when given; else, where the XLA implementation
    runs, ``LmHeadBlockSizes(dweight="vocab")``.

    tunix users come for memory: the op's own default keeps a float32 ``[H, V]``
    weight-gradient accumulator (2.3 GiB at Qwen3-8B's head), which at a few thousand tokens
    is most of what the fused loss plans. By vocabulary blocks it is gone, for one more matmul
    of the logits' size (docs/integrations/tunix.md has both). Pass
    ``LmHeadBlockSizes()`` for the faster mode.
    """
    if options is not None:
        return options
    chosen = default_head_impl() if impl == "auto" else impl
    return LmHeadBlockSizes(dweight="vocab") if chosen == "xla" else None


def register(impl: str = "auto", options: Any = None, fused_options: Any = None,
             logits_from: str = "auto") -> None:
    """Registers :data:`POLICY_LOSSES` in tunix's function registry.

    Done on import with the defaults; call it again to choose the implementation (``impl``)
    or its options: ``options`` for ``"grpo_kernels"`` (``XlaBlockSizes`` / ``PallasOptions``),
    ``fused_options`` for ``"grpo_kernels_fused"`` (``LmHeadBlockSizes`` /
    ``LmHeadPallasOptions``, e.g. a smaller ``chunk_bytes``; ``None``: :func:`fused_options`'s
    choice), and where ``"grpo_kernels"`` takes its logits from (``logits_from``, as in
    :func:`logits_policy_loss`). tunix logs that it overwrites the earlier registration.
    """
    _check_logits_from(logits_from)
    from tunix.rl import function_registry

    function_registry.register_policy_loss_fn("grpo_kernels")(
        functools.partial(logits_policy_loss, impl=impl, options=options,
                          logits_from=logits_from))
    function_registry.register_policy_loss_fn("grpo_kernels_fused")(
        functools.partial(fused_policy_loss, impl=impl, options=fused_options))


# --- the log-prob passes ---------------------------------------------------------------------

# tunix's own compute_per_token_logps while ours is bound in its place (patch_log_probs).
_TUNIX_LOG_PROBS: Any = None
# The static arguments of tunix's jitted compute_per_token_logps (tunix/rl/common.py).
STATIC_ARGNAMES: tuple[str, ...] = ("pad_id", "eos_id", "stop_gradient", "return_logits",
                                    "temperature")


def _log_probs_from_hidden(impl: str, options: Any, tunix_fn: Callable) -> Callable:
    """The jitted pass of :func:`log_probs_function` for the calls it handles: the model
    read below its logits (or, for a model it cannot read, ``tunix_fn`` inlined)."""
    from flax import nnx

    @functools.partial(jax.jit, static_argnames=("pad_id", "eos_id", "stop_gradient",
                                                 "temperature"))
    def log_probs(graphdef, state, prompt_tokens, completion_tokens, pad_id, eos_id,
                  stop_gradient=True, temperature=1.0):
        model = nnx.merge(graphdef, state)
        if head_blocker(model) is not None:
            return tunix_fn(graphdef, state, prompt_tokens, completion_tokens, pad_id, eos_id,
                            stop_gradient=stop_gradient, temperature=temperature)
        t = completion_tokens.shape[1]
        hidden, head = completion_hidden(
            model, token_inputs(model, prompt_tokens, completion_tokens, pad_id, eos_id), t)
        # tunix divides the logits by the temperature unless it is 0 or 1
        tau = 1.0 if temperature in (0, 0.0, 1, 1.0) else temperature
        where = placement(model, hidden.shape[0], head_vocab(head), head)
        logps_fn = token_logps_from_hidden if where is None else functools.partial(
            sharded_token_logps_from_hidden, mesh=where[0], sharding=where[1])
        logps = logps_fn(hidden, head.weights, completion_tokens, lm_head_layout=head.layout,
                         logits_dtype=head.dtype, logit_softcap=head.softcap,
                         temperature=tau, impl=impl, options=fused_options(impl, options))
        return jax.lax.stop_gradient(logps) if stop_gradient else logps

    return log_probs


def log_probs_function(impl: str = "auto", options: Any = None,
                       tunix_fn: Callable | None = None) -> Callable:
    r"""A drop-in for ``tunix.rl.common.compute_per_token_logps`` (tunix 0.1.7): same
    signature, same static arguments, same results, without the ``[B, P + T, V]`` logits.

    For a model :func:`~grpo_kernels.integrations.tunix_modules.head_blocker` lets us read, the
    completion's log-probs come from the hidden states of the completion positions only
    (:func:`~grpo_kernels.integrations.tunix_modules.completion_hidden`) through
    :func:`grpo_kernels.token_logps_from_hidden` (``impl``, ``options``: as there; ``None``:
    :func:`fused_options`' choice), the head's logits rounded to the model's dtype as its own
    einsum rounds them, divided by the temperature as tunix divides them (unless it is 0 or
    1). Every other call goes to ``tunix_fn`` (default: tunix's function) unchanged:
    ``return_logits=True``, packed ``segment_ids`` or ``segment_positions``, ``images``, a
    negative temperature, any keyword it does not know, and a model it cannot read.
    """
    if tunix_fn is None:
        from tunix.rl import common

        tunix_fn = _TUNIX_LOG_PROBS or common.compute_per_token_logps
    ours = _log_probs_from_hidden(impl, options, tunix_fn)

    def compute_per_token_logps(graphdef, state, prompt_tokens, completion_tokens, pad_id,
                                eos_id, images=None, stop_gradient=True, return_logits=False,
                                segment_ids=None, segment_positions=None, temperature=1.0,
                                **unknown):
        theirs = (unknown or return_logits or images is not None or segment_ids is not None
                  or segment_positions is not None or not temperature >= 0)
        compute_per_token_logps.calls["tunix" if theirs else "ours"] += 1
        if theirs:
            return tunix_fn(graphdef, state, prompt_tokens, completion_tokens, pad_id, eos_id,
                            images=images, stop_gradient=stop_gradient,
                            return_logits=return_logits, segment_ids=segment_ids,
                            segment_positions=segment_positions, temperature=temperature,
                            **unknown)
        return ours(graphdef, state, prompt_tokens, completion_tokens, pad_id, eos_id,
                    stop_gradient=stop_gradient, temperature=temperature)

    compute_per_token_logps.grpo_kernels = True  # how patch_log_probs knows its own
    # Calls so far by who answered them: "ours", or "tunix" (its function, as called). A
    # model we cannot read counts as ours here and is answered by tunix's function inlined.
    compute_per_token_logps.calls = {"ours": 0, "tunix": 0}
    return compute_per_token_logps


def patch_log_probs(impl: str = "auto", options: Any = None) -> None:
    """Binds :func:`log_probs_function` in place of ``tunix.rl.common.
    compute_per_token_logps``.

    Every tunix caller looks the function up in that module when it calls it: the reference
    log-probs (the inference worker), the old-policy log-probs (the vanilla rollout), the
    agentic anchor pass; so after this call a whole GRPO iteration holds no ``[B, P + T, V]``
    array for a model our adapter reads (with ``policy_loss_fn="grpo_kernels_fused"`` for the
    update). Calling it again replaces the bound options; tunix's own function is kept for
    :func:`unpatch_log_probs`.
    """
    global _TUNIX_LOG_PROBS
    from tunix.rl import common

    current = common.compute_per_token_logps
    if _TUNIX_LOG_PROBS is None:
        if getattr(current, "grpo_kernels", False):
            raise ValueError("tunix.rl.common.compute_per_token_logps is already a grpo_kernels "
                             "function that this module did not bind; unbind it first")
        _TUNIX_LOG_PROBS = current
    common.compute_per_token_logps = log_probs_function(impl, options, _TUNIX_LOG_PROBS)


def unpatch_log_probs() -> None:
    """Restores tunix's own ``compute_per_token_logps`` (the function object it had before
    :func:`patch_log_probs`); a no-op when nothing is bound."""
    global _TUNIX_LOG_PROBS
    if _TUNIX_LOG_PROBS is None:
        return
    from tunix.rl import common

    common.compute_per_token_logps = _TUNIX_LOG_PROBS
    _TUNIX_LOG_PROBS = None


@contextlib.contextmanager
def log_probs_patched(impl: str = "auto", options: Any = None) -> Iterator[None]:
    """``with log_probs_patched(): ...``: :func:`patch_log_probs` inside the block,
    :func:`unpatch_log_probs` after it (also on an exception).

    Examples:
      >>> from tunix.rl import common
      >>> own = common.compute_per_token_logps
      >>> with log_probs_patched():
      ...     common.compute_per_token_logps is own
      False
      >>> common.compute_per_token_logps is own
      True
    """
    patch_log_probs(impl, options)
    try:
        yield
    finally:
        unpatch_log_probs()


register()
