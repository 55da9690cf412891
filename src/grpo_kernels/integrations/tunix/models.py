r"""Models read below their logits: final hidden states and LM-head weights, or a head function.

Both registered losses (:mod:`grpo_kernels.integrations.tunix`) read a tunix Qwen2, Qwen3,
Llama3, Gemma3 or Gemma (tunix 0.1.7 and its development head) this way, when they can: the
fused loss to hold no ``[B, T, V]`` array at all, the logits-level loss to form the
completion's logits itself, ``hidden[:, -T-1:-1] @ W`` in the model's compute dtype, where
tunix's ``__call__`` forms every position's (Qwen2 and Qwen3 cast them to float32:
:func:`completion_logits`). Both give the
same numbers as the model's ``__call__``, which :func:`call_model` calls as tunix's loss does.

Which way a model is read (:func:`head_blocker`):

- a tunix Qwen2, Qwen3 or Llama3 whose ``__call__`` is the class's own: decoder layers run
  here as modules (:func:`hidden_states`), the embedding lookup by :func:`tied_lookup`;
- a tunix Gemma3 or Gemma: the hidden states its own ``__call__`` sows
  (``output_hidden_states=True``; under ``jit`` the unused logits are dropped); a Gemma's
  final-logit soft cap (Gemma 2's ``final_logit_softcap``) goes to the ops as
  ``logit_softcap``;
- any of those adapted by qwix (``qwix.apply_lora_to_model``, the way tunix adds LoRA): qwix
  swaps the class for one whose ``__call__`` intercepts the matmuls, so the adapters act only
  inside that call, and the hidden states are the ones that call returns with
  ``skip_lm_head=True`` (tunix's head) or sows. tunix 0.1.7's Llama3 ``__call__`` does neither,
  and an adapter on the LM head itself cannot be seen from its weights: those models are not
  read;
- any other model that follows tunix's chunked-log-prob protocol (:func:`head_function`): its
  ``__call__`` takes ``skip_lm_head=True`` and returns the final hidden states, and its
  ``compute_final_logits`` maps hidden states to logits (the development head's tunix
  classes; MaxText's ``TunixMaxTextAdapter`` since MaxText PR 5301, whose hidden states come
  before the final norm, which ``compute_final_logits`` applies). Its head weights are not
  read: the losses run ``compute_final_logits`` one chunk of tokens at a time
  (:func:`grpo_kernels.ops.logps.head_fn.token_logps_from_head_fn`);
- anything else (another class, or a subclass with its own ``__call__`` and no protocol) is
  not read.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from grpo_kernels.ops.core.online_softmax import soft_cap
from grpo_kernels.ops.lm_head_loss.head import head_logits
from grpo_kernels.ops.lm_head_loss.lookup import tied_lookup

Array = jax.Array


class Head(NamedTuple):
    """A model's LM head as the fused loss takes it (``softcap``: its final-logit soft cap,
    or None)."""

    weights: Array
    layout: str
    dtype: Any
    softcap: float | None = None


# Families read only through their own __call__ (their layers are not run here as modules).
BY_CALL: tuple[str, ...] = ("gemma3", "gemma")


def _supported() -> dict[type, str]:
    from tunix.models.gemma.model import Gemma
    from tunix.models.gemma3.model import Gemma3
    from tunix.models.llama3.model import Llama3
    from tunix.models.qwen2.model import Qwen2
    from tunix.models.qwen3.model import Qwen3

    return {Qwen2: "qwen2", Qwen3: "qwen3", Llama3: "llama3", Gemma3: "gemma3", Gemma: "gemma"}


def _supported_class(model: Any) -> tuple[type, str]:
    """The tunix class ``model`` is an instance of, and its family; ValueError naming any
    other class."""
    for cls, family in _supported().items():
        if isinstance(model, cls):
            return cls, family
    names = ", ".join(cls.__name__ for cls in _supported())
    raise ValueError(f"{type(model).__name__} is not a tunix {names}")


def model_family(model: Any) -> str:
    """``"qwen2"``, ``"qwen3"``, ``"llama3"``, ``"gemma3"`` or ``"gemma"``; ValueError naming
    any other class."""
    return _supported_class(model)[1]


def call_model(model: Any, inputs: dict[str, Any], **extra: Any) -> tuple[Array, Any]:
    """``model(tokens, positions=..., attention_mask=..., cache=None, ...)``: tunix's own call
    (``common.compute_per_token_logps``), tokens by position, since the classes name that
    argument differently (``input_tokens``, Gemma3's ``last_tokens``)."""
    kwargs = {k: v for k, v in inputs.items() if k != "input_tokens"}
    return model(inputs["input_tokens"], **kwargs, cache=None, **extra)


def qwix_adapted(model: Any) -> bool:
    """Whether qwix has swapped the model's class for an intercepting one (LoRA, QAT)."""
    return hasattr(type(model), "_unquantized_type")


def call_accepts(model: Any, name: str) -> bool:
    """Whether ``type(model).__call__`` takes a keyword ``name`` (or ``**kwargs``)."""
    try:
        params = inspect.signature(type(model).__call__).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return name in params or any(p.kind == inspect.Parameter.VAR_KEYWORD
                                 for p in params.values())


def skips_lm_head(model: Any) -> bool:
    """Whether the model's call returns its final hidden states with ``skip_lm_head=True``
    (tunix's development head; tunix 0.1.7's classes do not). A qwix-adapted class keeps the
    wrapped class's parameters."""
    base = type(model)._unquantized_type if qwix_adapted(model) else type(model)
    try:
        params = inspect.signature(base.__call__).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return "skip_lm_head" in params


def head_function(model: Any) -> str | None:
    """Why ``model`` does not follow tunix's chunked-log-prob protocol (None: it does): a
    ``__call__`` that takes ``skip_lm_head`` and a callable ``compute_final_logits``. A
    qwix-adapted model does not: its adapters act inside its ``__call__`` only, and
    ``compute_final_logits`` runs outside it."""
    if qwix_adapted(model):
        return "qwix adapters act inside its __call__, not in compute_final_logits"
    if not skips_lm_head(model):
        return f"{type(model).__name__}.__call__ takes no skip_lm_head"
    if not callable(getattr(model, "compute_final_logits", None)):
        return f"{type(model).__name__} has no compute_final_logits"
    return None


def _tied(model: Any, family: str) -> bool:
    if family in BY_CALL:
        return True  # tunix's Gemma and Gemma3 decode with the input embedding
    return model.config.weight_tying if family == "llama3" else model.config.use_tied_embedding


def head_adapters(model: Any) -> list[str]:
    """The qwix LoRA parameters (``nnx.LoRAParam``) on the LM head's module: the embedder
    when the head is tied, else ``lm_head``."""
    from flax import nnx

    module = model.embedder if _tied(model, model_family(model)) else model.lm_head
    state = nnx.state(module, nnx.LoRAParam)
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(state)]


def head_blocker(model: Any) -> str | None:
    """Why ``model`` cannot be read below its logits (None: it can), in words."""
    try:
        cls, family = _supported_class(model)
    except ValueError as e:
        return str(e)
    base = type(model)._unquantized_type if qwix_adapted(model) else type(model)
    if base.__call__ is not cls.__call__:
        return f"{base.__name__} has its own __call__"
    if qwix_adapted(model) and family == "llama3" and not skips_lm_head(model):
        return "qwix adapters act inside Llama3.__call__, which returns no hidden states"
    adapters = head_adapters(model)
    if adapters:
        return f"its LM head carries qwix LoRA parameters ({', '.join(adapters)})"
    return None


def embed(model: Any, tokens: Array) -> tuple[Array, Array]:
    """``model.embedder.encode(tokens)`` (tunix 0.1.7 and its head: the rows, cast to the
    embedder's dtype except in Llama3, constrained to its ``act_btd`` sharding) by
    :func:`tied_lookup`, and the embedding table it passes through: a tied head that uses that
    table gets the lookup's gradient added into its own in place (no float32 copy of the table
    on XLA:CPU)."""
    embedder = model.embedder
    x, table = tied_lookup(embedder.input_embedding.get_value(), tokens)
    if model_family(model) != "llama3":
        x = jnp.astype(x, embedder.dtype)
    return importlib.import_module(type(embedder).__module__).shard(
        x, embedder.shd_config.act_btd), table


def _hidden_by_call(model: Any, inputs: dict[str, Any]) -> Array:
    """The final hidden states of the model's own ``__call__``: returned with
    ``skip_lm_head=True`` where it takes that, else sown (``all_hidden_states``, tunix 0.1.7's
    Qwen2/Qwen3/Gemma3/Gemma) and popped so that no intermediate stays on the model."""
    from flax import nnx

    if skips_lm_head(model):
        return call_model(model, inputs, skip_lm_head=True)[0]
    call_model(model, inputs, output_hidden_states=True)
    return nnx.pop(model, nnx.Intermediate)["all_hidden_states"].get_value()[-1]


def hidden_states(model: Any, inputs: dict[str, Any]) -> tuple[Array, Array]:
    """``([B, L, D]`` after the final norm, the embedding table for :func:`lm_head`): the
    model's ``__call__`` up to its head, with the same modules and arguments (tunix's Qwen2,
    Qwen3 and Llama3, 0.1.7 and the head alike; the lookup by :func:`embed`). Gemma3, Gemma
    and a qwix-adapted model run their own ``__call__`` (module docstring)."""
    family = model_family(model)
    if qwix_adapted(model) or family in BY_CALL:
        return _hidden_by_call(model, inputs), model.embedder.input_embedding.get_value()
    tokens, positions = inputs["input_tokens"], inputs["positions"]
    attn, seg = inputs["attention_mask"], inputs.get("segment_ids")
    x, table = embed(model, tokens)
    if family == "qwen2":
        from tunix.models.qwen2 import model as qwen2

        sin, cos = qwen2._generate_pos_embeddings(positions, model.config.head_dim,
                                                  model.config.rope_theta)
        sin, cos = sin.astype(x.dtype), cos.astype(x.dtype)
        for layer in model.layers:
            _, x = layer(x, None, attn, sin, cos, segment_ids=seg)
    elif family == "qwen3":
        for layer in model.layers:
            _, x = layer(x, positions, None, attn, segment_ids=seg)
    else:
        for layer in model.layers:
            _, x = layer(x, positions, None, attn)
    return model.final_norm(x), table


def lm_head(model: Any, hidden: Array, table: Array) -> Head:
    """The head weights in the dtype the model multiplies them in, and the logits' dtype:
    ``table`` (the embedding from :func:`hidden_states`) when the head is tied.

    Qwen2/Qwen3 cast both operands to ``config.dtype``; Llama3, Gemma3 and Gemma multiply
    as stored.
    """
    family = model_family(model)
    tied = _tied(model, family)
    w, layout = (table, "vh") if tied else (model.lm_head.w.get_value(), "hv")
    stored = family in ("llama3", *BY_CALL)
    dtype = jnp.result_type(hidden.dtype, w.dtype) if stored else model.config.dtype
    cap = getattr(model, "final_logits_softcap", None) if family == "gemma" else None
    return Head(w.astype(dtype), layout, jnp.dtype(dtype), cap)


def head_vocab(head: Head) -> int:
    """``V`` of a :class:`Head`."""
    return head.weights.shape[1] if head.layout == "hv" else head.weights.shape[0]


def completion_hidden(model: Any, inputs: dict[str, Any], t: int) -> tuple[Array, Head]:
    """The hidden states that predict the last ``t`` tokens (``[B, t, D]``, in the head's
    dtype) and the head: what both losses read (:func:`head_blocker` must be None)."""
    hidden, table = hidden_states(model, inputs)
    hidden = hidden[:, -t - 1:-1, :]
    head = lm_head(model, hidden, table)
    return hidden.astype(head.dtype), head


def completion_logits(model: Any, inputs: dict[str, Any], t: int) -> Array:
    """``[B, t, V]`` logits of the last ``t`` tokens in the model's logits dtype: the values
    of ``call_model(...)[0][:, -t-1:-1]`` before tunix's float32 cast (Qwen2, Qwen3), which is
    exact, so a loss that reads them in float32 sees the same numbers. The gradient comes back
    in that dtype, as through the cast's transpose."""
    hidden, head = completion_hidden(model, inputs, t)
    logits = head_logits(hidden, head.weights, head.layout, None, head.dtype)
    if head.softcap is None:
        return logits
    # the model caps its logits in their own dtype, as here
    return soft_cap(logits.astype(jnp.float32), head.softcap).astype(head.dtype)


def function_hidden(model: Any, inputs: dict[str, Any], t: int) -> Array:
    """``[B, t, D]``: the hidden states that predict the last ``t`` tokens, as a model of the
    chunked-log-prob protocol (:func:`head_function` is None) returns them with
    ``skip_lm_head=True``; its ``compute_final_logits`` maps them to logits."""
    return call_model(model, inputs, skip_lm_head=True)[0][:, -t - 1:-1, :]


def reading(model: Any) -> str:
    """How the losses and the log-prob pass read ``model``: ``"head"`` (hidden states and
    head weights, :func:`head_blocker` is None), ``"function"`` (hidden states and
    ``compute_final_logits``, :func:`head_function` is None) or ``"call"`` (neither: the
    model's own ``__call__``, its whole logits)."""
    if head_blocker(model) is None:
        return "head"
    return "function" if head_function(model) is None else "call"


def not_read(model: Any) -> str:
    """Why ``model`` is read by its ``__call__`` alone, in words (both readings' reasons)."""
    return f"{head_blocker(model)}; and {head_function(model)}"
