r"""The two policy losses tunix's learners call: ``(model, train_example, algo_config, pad_id,
eos_id, **kwargs)`` -> what the installed tunix's own losses return (:mod:`.outputs`).

Both compute tunix's ``grpo_loss_fn`` (tunix/rl/algo_core.py) on the same inputs, packed rows
included (:mod:`.inputs`), whichever way the model is read (:func:`~grpo_kernels.integrations.
tunix.models.reading`). tunix's keyword arguments beyond those (the head's
``compute_logps_chunk_size``, which chunks its own log-prob pass) are accepted and change
nothing: ours never forms the whole ``[B, T, V]`` to begin with.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.integrations.tunix.config import field, loss_config
from grpo_kernels.integrations.tunix.inputs import Example, example_inputs, model_inputs
from grpo_kernels.integrations.tunix.models import (call_model, completion_hidden,
                                                    completion_logits, function_hidden,
                                                    head_vocab, not_read, reading)
from grpo_kernels.integrations.tunix.outputs import policy_output
from grpo_kernels.integrations.tunix.placement import placement
from grpo_kernels.objective.batch import TokenBatch
from grpo_kernels.ops.core.truncation import config_truncation, outside_count
from grpo_kernels.ops.core.validate import validate_token_inputs
from grpo_kernels.ops.lm_head_loss.api import default_impl as default_head_impl
from grpo_kernels.ops.lm_head_loss.api import grpo_loss_from_hidden
from grpo_kernels.ops.lm_head_loss.xla_plan import LmHeadBlockSizes
from grpo_kernels.ops.logits_loss.api import default_impl as default_logits_impl
from grpo_kernels.ops.logits_loss.api import grpo_loss
from grpo_kernels.ops.logits_loss.pallas import PallasOptions
from grpo_kernels.ops.logps.head_fn import token_logps_from_head_fn
from grpo_kernels.sharding import sharded_grpo_loss, sharded_grpo_loss_from_hidden

Array = jax.Array

POLICY_LOSSES: tuple[str, ...] = ("grpo_kernels", "grpo_kernels_fused")
# Where the logits-level loss takes its logits from (logits_policy_loss).
LOGITS_FROM: tuple[str, ...] = ("auto", "model")


def check_logits_from(logits_from: str) -> None:
    if logits_from not in LOGITS_FROM:
        raise ValueError(f"logits_from: must be one of {list(LOGITS_FROM)}, got {logits_from!r}")


def _loss_kwargs(ex: Example) -> dict[str, Any]:
    return dict(old_logps=ex.old_logps, ref_logps=ex.ref_logps,
                sampler_weights=ex.sampler_weights, segments=ex.segments)


def _prepare(train_example: Any, algo_config: Any) -> tuple[Example, GRPOLossConfig]:
    ex = example_inputs(train_example)
    config = loss_config(algo_config, ex.ref_logps is not None,
                         tuple(train_example.completion_ids.shape), packed=ex.packed)
    return ex, config


def logits_policy_loss(model: Any, train_example: Any, algo_config: Any, pad_id: int,
                       eos_id: int, impl: str = "auto", options: Any = None,
                       logits_from: str = "auto", **kwargs: Any) -> Any:
    """tunix's GRPO loss through :func:`grpo_kernels.grpo_loss` on the completion's logits,
    with ``impl`` and ``options`` as there (other keyword arguments of tunix's call are
    ignored).

    ``logits_from="auto"`` forms the completion's logits from the model's hidden states: by
    its head weights where :func:`~grpo_kernels.integrations.tunix.models.head_blocker`
    allows it (:func:`~grpo_kernels.integrations.tunix.models.completion_logits`: in the
    model's dtype, without tunix's float32 copy), else by its ``compute_final_logits`` for a
    model of tunix's chunked-log-prob protocol; else, and with ``"model"``, it calls the model
    (every position's logits). All give the same numbers.
    """
    check_logits_from(logits_from)
    ex, config = _prepare(train_example, algo_config)
    inputs = model_inputs(model, train_example, pad_id, eos_id)
    t = ex.ids.shape[1]
    how = reading(model) if logits_from == "auto" else "call"
    if how == "head":
        logits = completion_logits(model, inputs, t)
    elif how == "function":
        logits = model.compute_final_logits(function_hidden(model, inputs, t))
    else:
        logits = call_model(model, inputs)[0][:, -t - 1:-1, :]
    where = placement(model, *logits.shape[::2],
                      whole_rows=config_truncation(config, logits.shape[-1]) is not None)
    loss_fn = grpo_loss if where is None else functools.partial(
        sharded_grpo_loss, mesh=where[0], sharding=where[1])
    loss, metrics = loss_fn(logits, ex.ids, ex.mask, ex.advantages, config=config,
                            impl=impl, options=logits_options(impl, options),
                            **_loss_kwargs(ex))
    return policy_output(loss, metrics, ex, config, field(algo_config, "epsilon_c"))


def fused_policy_loss(model: Any, train_example: Any, algo_config: Any, pad_id: int,
                      eos_id: int, impl: str = "auto", options: Any = None,
                      **kwargs: Any) -> Any:
    """tunix's GRPO loss without a ``[B, T, V]`` array: from the model's hidden states and
    head weights through :func:`grpo_kernels.grpo_loss_from_hidden` (``impl`` and ``options``
    as there), or, for a model of tunix's chunked-log-prob protocol whose head weights cannot
    be read (MaxText's adapter), through its ``compute_final_logits`` a chunk of tokens at a
    time (:func:`grpo_kernels.token_logps_from_head_fn`; ``options`` as its ``blocks``).
    Other keyword arguments are ignored. A model read neither way raises ValueError."""
    how = reading(model)
    if how == "call":  # before any work
        raise ValueError(f"grpo_kernels_fused needs a model's hidden states and its head "
                         f"(weights or compute_final_logits): {not_read(model)} (use "
                         f"policy_loss_fn='grpo_kernels' for it)")
    ex, config = _prepare(train_example, algo_config)
    inputs = model_inputs(model, train_example, pad_id, eos_id)
    t = ex.ids.shape[1]
    if how == "function":
        loss, metrics = function_loss(model, function_hidden(model, inputs, t), ex, config,
                                      options)
    else:
        hidden, head = completion_hidden(model, inputs, t)
        vocab = head_vocab(head)
        where = placement(model, hidden.shape[0], vocab, head,
                          whole_rows=config_truncation(config, vocab) is not None)
        loss_fn = grpo_loss_from_hidden if where is None else functools.partial(
            sharded_grpo_loss_from_hidden, mesh=where[0], sharding=where[1])
        loss, metrics = loss_fn(
            hidden, head.weights, ex.ids, ex.mask, ex.advantages, config=config,
            impl=impl, options=fused_options(impl, options), lm_head_layout=head.layout,
            logits_dtype=head.dtype, logit_softcap=head.softcap, **_loss_kwargs(ex))
    return policy_output(loss, metrics, ex, config, field(algo_config, "epsilon_c"))


def function_blocks(options: Any) -> LmHeadBlockSizes | None:
    """The chunking of the ``compute_final_logits`` path: ``options`` when they are
    ``LmHeadBlockSizes``, else the default."""
    return options if isinstance(options, LmHeadBlockSizes) else None


def function_loss(model: Any, hidden: Array, ex: Example, config: GRPOLossConfig,
                  options: Any = None) -> tuple[Array, dict[str, Array]]:
    """``(loss, metrics)`` of :func:`grpo_kernels.grpo_loss` with the logits
    ``model.compute_final_logits(hidden)``, formed a chunk at a time: the log-probs and
    entropies of :func:`grpo_kernels.token_logps_from_head_fn` (under the config's sampler
    truncation, with the metric ``outside_truncation``), the objective on them."""
    vocab = jax.eval_shape(model.compute_final_logits, hidden[:, :1]).shape[-1]
    trunc = config_truncation(config, vocab)
    validate_token_inputs(jax.ShapeDtypeStruct((*ex.ids.shape, vocab), hidden.dtype), ex.ids,
                          ex.mask, ex.advantages, config, ex.old_logps, ex.ref_logps,
                          ex.sampler_weights, None, ex.segments)
    sampler = {} if trunc is None else dict(top_k=trunc.top_k, top_p=trunc.top_p,
                                             min_p=trunc.min_p)
    logp, entropy, outside = token_logps_from_head_fn(
        hidden, model.compute_final_logits, ex.ids, temperature=config.temperature,
        return_entropy=True, blocks=function_blocks(options), return_outside=True, **sampler)
    batch = TokenBatch.of(ex.ids, ex.mask, ex.advantages, ex.old_logps, ex.ref_logps, None,
                          ex.sampler_weights, None, ex.segments)
    loss, metrics, _ = batch.loss(logp, entropy, config, with_grad=False)
    if trunc is not None:
        metrics["outside_truncation"] = outside_count(outside, batch.mask)
    return loss, metrics


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
    check_logits_from(logits_from)
    from tunix.rl import function_registry

    function_registry.register_policy_loss_fn("grpo_kernels")(
        functools.partial(logits_policy_loss, impl=impl, options=options,
                          logits_from=logits_from))
    function_registry.register_policy_loss_fn("grpo_kernels_fused")(
        functools.partial(fused_policy_loss, impl=impl, options=fused_options))
