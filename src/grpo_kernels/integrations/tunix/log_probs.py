r"""Our log-prob pass in place of ``tunix.rl.common.compute_per_token_logps``.

Every tunix caller looks that function up in its module when it calls it, so binding ours
there (:func:`patch_log_probs`) serves them all, on tunix 0.1.7 and its development head:
the reference pass (the inference worker, with packed rows' segment ids), the old policy's
(the vanilla rollout; ``RLCluster.get_actor_per_token_logps`` with its ``chunk_size``), and
the policy losses that differentiate it (the head's ``grpo_loss_fn``, ``return_entropy=True``,
``stop_gradient=False``; ``ppo_policy_loss_fn``).

For a model read below its logits (:func:`~grpo_kernels.integrations.tunix.models.reading`)
the completion's log-probs (and entropies) come from its hidden states without the
``[B, P + T, V]`` logits tunix forms: through its head weights
(:func:`grpo_kernels.token_logps_from_hidden`, the logits rounded to the model's dtype as its
own einsum rounds them) or its ``compute_final_logits`` a chunk at a time
(:func:`grpo_kernels.token_logps_from_head_fn`); divided by the temperature as tunix divides
them (unless it is 0 or 1); the entropy from the same statistics. Packed rows come back as
tunix returns them: ``[B, L]``, position 0 padded (log-prob 0; entropy 0 in the head's chunked
mode, else that of the zero logits it pads, ``log V``). The head's ``chunk_size`` changes
nothing else: ours holds no ``[B, T, V]`` whatever it is.

With a sampler's truncation bound (:func:`patch_log_probs`' ``truncation``, set by
:func:`~grpo_kernels.integrations.tunix.follow_sampler`) every pass we answer gives the
log-probs of the distribution the sampler drew from (:func:`grpo_kernels.token_logps_from_hidden`'s
``top_k`` / ``top_p`` / ``min_p``), and the entropies of it; on a mesh each device then holds
whole rows of its batch shard (the head gathered whole; :func:`placement`'s ``whole_rows``);
through a ``compute_final_logits`` head each chunk of positions holds whole rows. A model read
by neither way raises ValueError rather than return the whole vocabulary's.

Every other call goes to tunix's function with exactly the arguments its caller gave: logits
asked for (0.1.7's ``return_logits``), images, a negative temperature, an argument tunix's
signature does not take or that we do not know, a model read by neither way, ``chunk_size``
for a model tunix's own chunked pass refuses.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp

from grpo_kernels.integrations.tunix.inputs import token_inputs
from grpo_kernels.integrations.tunix.losses import function_blocks, fused_options
from grpo_kernels.integrations.tunix.models import (completion_hidden, function_hidden,
                                                    head_function, head_vocab, reading)
from grpo_kernels.integrations.tunix.placement import placement
from grpo_kernels.ops.core.truncation import Truncation
from grpo_kernels.ops.logps.api import token_logps_from_hidden
from grpo_kernels.ops.logps.head_fn import token_logps_from_head_fn
from grpo_kernels.sharding import sharded_token_logps_from_hidden

Array = jax.Array

# tunix's own compute_per_token_logps while ours is bound in its place (patch_log_probs).
_TUNIX_LOG_PROBS: Any = None
# The arguments of compute_per_token_logps (0.1.7's and the head's) and what each must be for
# us to answer; any other argument a tunix version adds must keep its default.
ANSWERED: dict[str, Callable[[Any], bool]] = {
    "graphdef": lambda v: True, "state": lambda v: True,
    "prompt_tokens": lambda v: True, "completion_tokens": lambda v: True,
    "pad_id": lambda v: True, "eos_id": lambda v: True,
    "images": lambda v: v is None, "return_logits": lambda v: not v,
    "stop_gradient": lambda v: True, "return_entropy": lambda v: True,
    "segment_ids": lambda v: True, "segment_positions": lambda v: True,
    "temperature": lambda v: isinstance(v, (int, float)) and v >= 0,
    "chunk_size": lambda v: isinstance(v, int) and v >= 0,
}


def answerable(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict | None:
    """The caller's arguments by name (those it gave), when ours answers the call; else None.
    Packed rows without positions are tunix's to refuse."""
    try:
        given = signature.bind(*args, **kwargs).arguments
    except TypeError:
        return None
    for name, param in signature.parameters.items():
        value = given.get(name, param.default)
        check = ANSWERED.get(name)
        if (check is None and value is not param.default) or (check and not check(value)):
            return None
    if given.get("segment_ids") is not None and given.get("segment_positions") is None:
        return None
    return given


def _packed_entropy_front(vocab: int, chunk_size: int) -> float:
    """The entropy tunix gives position 0 of a packed row: 0 in its chunked pass, else that of
    the zero logits it pads there."""
    return 0.0 if chunk_size > 0 else math.log(vocab)


def refuse_truncated(trunc: Truncation | None, why: str, vocab: float = math.inf) -> None:
    """ValueError when ``trunc`` drops tokens of a ``vocab``-wide row (unknown: any width) on
    a pass (``why``) that cannot take it."""
    if trunc is not None and trunc.active(vocab):
        raise ValueError(f"the sampler's truncation ({trunc}): the log-prob pass {why} keeps "
                         f"the whole vocabulary; read the model's head weights on one device, "
                         f"or bind no truncation")


def _log_probs_pass(impl: str, options: Any, tunix_fn: Callable,
                    trunc: Truncation | None) -> Callable:
    """The jitted pass of :func:`log_probs_function` for the calls it answers; a model read by
    neither way (or a chunked call tunix refuses for it) gets ``tunix_fn`` inlined, with the
    arguments its caller gave (``given``)."""
    from flax import nnx

    sampler = {} if trunc is None else dict(top_k=trunc.top_k, top_p=trunc.top_p,
                                             min_p=trunc.min_p)

    @functools.partial(jax.jit, static_argnames=("pad_id", "eos_id", "stop_gradient",
                                                 "temperature", "return_entropy",
                                                 "chunk_size", "given"))
    def log_probs(graphdef, state, prompt_tokens, completion_tokens, segment_ids,
                  segment_positions, *, pad_id, eos_id, stop_gradient, temperature,
                  return_entropy, chunk_size, given):
        model = nnx.merge(graphdef, state)
        how = reading(model)
        if how == "call" or (chunk_size > 0 and head_function(model) is not None):
            refuse_truncated(trunc, "through tunix's function")
            values = dict(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          pad_id=pad_id, eos_id=eos_id, images=None, stop_gradient=stop_gradient,
                          return_logits=False, return_entropy=return_entropy,
                          segment_ids=segment_ids, segment_positions=segment_positions,
                          temperature=temperature, chunk_size=chunk_size)
            return tunix_fn(graphdef, state, **{n: values[n] for n in given})
        inputs = token_inputs(model, prompt_tokens, completion_tokens, pad_id, eos_id,
                              segment_ids, segment_positions)
        tokens = inputs["input_tokens"]
        packed = segment_ids is not None
        t = tokens.shape[1] - 1 if packed else completion_tokens.shape[1]
        ids = tokens[:, -t:]
        tau = 1.0 if temperature in (0, 0.0, 1, 1.0) else temperature
        if how == "function":
            hidden = function_hidden(model, inputs, t)
            vocab = jax.eval_shape(model.compute_final_logits, hidden[:, :1]).shape[-1]
            logp, ent = token_logps_from_head_fn(hidden, model.compute_final_logits, ids,
                                                 temperature=tau, return_entropy=True,
                                                 blocks=function_blocks(options), **sampler)
        else:
            hidden, head = completion_hidden(model, inputs, t)
            vocab = head_vocab(head)
            where = placement(model, hidden.shape[0], vocab, head,
                              whole_rows=trunc is not None and trunc.active(vocab))
            logps_fn = functools.partial(token_logps_from_hidden, **sampler) if where is None \
                else functools.partial(sharded_token_logps_from_hidden, mesh=where[0],
                                       sharding=where[1], **sampler)
            logp, ent = logps_fn(hidden, head.weights, ids, lm_head_layout=head.layout,
                                 logits_dtype=head.dtype, logit_softcap=head.softcap,
                                 temperature=tau, impl=impl, return_entropy=True,
                                 options=fused_options(impl, options))
        if packed:
            logp = jnp.pad(logp, ((0, 0), (1, 0)))
            ent = jnp.pad(ent, ((0, 0), (1, 0)),
                          constant_values=_packed_entropy_front(vocab, chunk_size))
        if stop_gradient:
            logp, ent = jax.lax.stop_gradient(logp), jax.lax.stop_gradient(ent)
        return (logp, ent) if return_entropy else logp

    return log_probs


def log_probs_function(impl: str = "auto", options: Any = None,
                       tunix_fn: Callable | None = None,
                       truncation: Truncation | None = None) -> Callable:
    r"""A drop-in for the installed tunix's ``compute_per_token_logps``: same signature, same
    results, without the ``[B, P + T, V]`` logits (module docstring).

    ``impl``, ``options``: as in :func:`grpo_kernels.token_logps_from_hidden` (``None``:
    :func:`~grpo_kernels.integrations.tunix.fused_options`' choice; ``LmHeadBlockSizes`` also
    chunk a ``compute_final_logits`` head). ``tunix_fn``: the function it stands in for and
    hands the other calls to (default: tunix's). ``truncation``: the sampler's, applied to every
    pass it answers (module docstring; None: the whole vocabulary).

    The returned function carries its arguments in its ``bound`` attribute (``impl``,
    ``options``, ``truncation``) and counts the calls by who answered them in its ``calls``
    attribute: ``"ours"``, or ``"tunix"`` (its function, as called). A model read by neither
    way counts as ours and is answered by tunix's function inlined in our jitted pass.
    """
    if tunix_fn is None:
        from tunix.rl import common

        tunix_fn = _TUNIX_LOG_PROBS or common.compute_per_token_logps
    signature = inspect.signature(tunix_fn)
    ours = _log_probs_pass(impl, options, tunix_fn, truncation)

    @functools.wraps(tunix_fn)
    def compute_per_token_logps(*args: Any, **kwargs: Any) -> Any:
        given = answerable(signature, args, kwargs)
        compute_per_token_logps.calls["tunix" if given is None else "ours"] += 1
        if given is None:
            return tunix_fn(*args, **kwargs)
        full = {name: given.get(name, param.default)
                for name, param in signature.parameters.items()}
        return ours(full["graphdef"], full["state"], full["prompt_tokens"],
                    full["completion_tokens"], full.get("segment_ids"),
                    full.get("segment_positions"), pad_id=full["pad_id"],
                    eos_id=full["eos_id"], stop_gradient=bool(full.get("stop_gradient", True)),
                    temperature=full.get("temperature", 1.0),
                    return_entropy=bool(full.get("return_entropy", False)),
                    chunk_size=int(full.get("chunk_size", 0)),
                    given=tuple(n for n in given if n not in ("graphdef", "state")))

    compute_per_token_logps.grpo_kernels = True  # how patch_log_probs knows its own
    compute_per_token_logps.calls = {"ours": 0, "tunix": 0}
    compute_per_token_logps.bound = dict(impl=impl, options=options, truncation=truncation)
    return compute_per_token_logps


def patch_log_probs(impl: str = "auto", options: Any = None,
                    truncation: Truncation | None = None) -> None:
    """Binds :func:`log_probs_function` in place of ``tunix.rl.common.
    compute_per_token_logps``.

    Every tunix caller looks the function up in that module when it calls it (module
    docstring), so after this call a whole GRPO iteration holds no ``[B, P + T, V]`` array for
    a model our adapter reads (with ``policy_loss_fn="grpo_kernels_fused"`` for the update).
    Calling it again replaces the bound options (``truncation`` included: the sampler's, as
    :func:`~grpo_kernels.integrations.tunix.follow_sampler` binds it); tunix's own function is
    kept for :func:`unpatch_log_probs`.
    """
    global _TUNIX_LOG_PROBS
    from tunix.rl import common

    current = common.compute_per_token_logps
    if _TUNIX_LOG_PROBS is None:
        if getattr(current, "grpo_kernels", False):
            raise ValueError("tunix.rl.common.compute_per_token_logps is already a grpo_kernels "
                             "function that this module did not bind; unbind it first")
        _TUNIX_LOG_PROBS = current
    common.compute_per_token_logps = log_probs_function(impl, options, _TUNIX_LOG_PROBS,
                                                        truncation)


def bound_options() -> dict[str, Any] | None:
    """The ``impl``, ``options`` and ``truncation`` our bound pass was bound with (its
    ``bound`` attribute), or None when tunix's own function is in place."""
    if _TUNIX_LOG_PROBS is None:
        return None
    from tunix.rl import common

    return dict(common.compute_per_token_logps.bound)


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
