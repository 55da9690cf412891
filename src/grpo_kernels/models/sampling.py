"""Batched sampling with a preallocated key/value cache: ``generate``.

One compiled program per ``(rows, prompt bucket, max_new_tokens)``: the prompts, left-padded to
a multiple of ``PROMPT_BUCKET`` tokens, are prefilled in one forward that writes the cache, then a
``while_loop`` runs one decode step per token (static shapes: the cache has room for the prompt
and every new token) until every row has produced an end token or ``max_new_tokens`` are done.

Sampling at step ``i`` with logits ``z``: ``temperature == 0`` is greedy; otherwise ``z / T``,
restricted by ``min_p``, then to the ``top_k`` largest, then to the smallest set of tokens whose
probability reaches ``top_p`` (vLLM's order; ties kept whole:
:mod:`grpo_kernels.ops.core.truncation`, the truncation the log-prob ops and the losses compute),
is sampled. The returned log-prob of each token is that of the distribution it was drawn from:
``log_softmax`` of the restricted ``z / T`` (vLLM's processed log-probs; the policy's own when
nothing is restricted; ``T = 1`` when greedy).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_kernels.models.decoder import Decoder, positions_from_mask
from grpo_kernels.ops.core.truncation import Truncation, support_floor, truncate

Array = jax.Array
PROMPT_BUCKET = 64


@dataclasses.dataclass(frozen=True)
class Generation:
    """Output of :func:`generate` for ``N = len(prompts) * num_generations`` rows (each prompt's
    generations adjacent).

    Attributes:
      prompt_ids: ``[N, P]`` left-padded prompts; ``prompt_mask`` ``[N, P]`` (1 = real).
      ids: ``[N, max_new_tokens]`` completions, ``pad_id`` after the end token.
      mask: ``[N, max_new_tokens]`` 1 up to and including each row's end token.
      logps: ``[N, max_new_tokens]`` float32 sampling log-probs (0 where ``mask`` is 0).
    """

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    ids: np.ndarray
    mask: np.ndarray
    logps: np.ndarray


def _check(prompts, num_generations, max_new_tokens, temperature, eos_ids):
    if not prompts or not all(isinstance(p, (list, tuple, np.ndarray)) and len(p) for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token id lists")
    for name, value in (("num_generations", num_generations), ("max_new_tokens", max_new_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not (isinstance(temperature, (int, float)) and temperature >= 0):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if not eos_ids:
        raise ValueError("eos_ids must name at least one end token id")


def _filter(z: Array, trunc: Truncation) -> Array:
    """``z [N, V]`` with the tokens the truncation drops at ``-inf``: the floor the log-prob
    ops and the losses compute (:mod:`grpo_kernels.ops.core.truncation`), so the two describe
    one distribution."""
    if not trunc.active(z.shape[-1]):
        return z
    return truncate(z, support_floor(z, trunc), False)


def _choose(z: Array, key: Array, temperature: float, trunc: Truncation) -> tuple[Array, Array]:
    """``(token [N], log-prob [N])`` from float32 logits ``z [N, V]``: the log-prob of the
    distribution the token was drawn from."""
    if temperature == 0:
        token = jnp.argmax(z, axis=-1)
        logp = jax.nn.log_softmax(z, axis=-1)
    else:
        kept = _filter(z / temperature, trunc)
        logp = jax.nn.log_softmax(kept, axis=-1)
        token = jax.random.categorical(key, kept, axis=-1)
    return token.astype(jnp.int32), jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


def _program(graphdef, max_new: int, temperature: float, trunc: Truncation,
             eos: tuple[int, ...], pad_id: int):
    """The compiled prefill + decode loop for one shape (see the module docstring)."""

    def run(state, prompt, prompt_mask, key):
        TRACES["count"] += 1  # runs at trace time only
        model: Decoder = nnx.merge(graphdef, state)
        n, p = prompt.shape
        total = p + max_new
        cache = model.init_cache(n, total)
        kv_mask = jnp.zeros((n, total), jnp.int32).at[:, :p].set(prompt_mask)
        logits, cache = model.extend(prompt, positions_from_mask(prompt_mask), kv_mask, cache, 0)
        lengths = jnp.sum(prompt_mask, axis=-1)
        eos_arr = jnp.asarray(eos, jnp.int32)
        out = jnp.full((n, max_new), pad_id, jnp.int32)
        logps = jnp.zeros((n, max_new), jnp.float32)
        done = jnp.zeros((n,), bool)

        def cond(carry):
            i, _, _, _, _, done, *_ = carry
            return (i < max_new) & ~jnp.all(done)

        def body(carry):
            i, logits, cache, kv_mask, key, done, out, logps = carry
            key, sub = jax.random.split(key)
            token, logp = _choose(logits, sub, temperature, trunc)
            token = jnp.where(done, pad_id, token)
            out = out.at[:, i].set(token)
            logps = logps.at[:, i].set(jnp.where(done, 0.0, logp))
            done = done | jnp.isin(token, eos_arr)
            kv_mask = kv_mask.at[:, p + i].set(1)
            logits, cache = model.extend(token[:, None], (lengths + i)[:, None], kv_mask, cache,
                                         p + i)
            return i + 1, logits, cache, kv_mask, key, done, out, logps

        carry = (jnp.int32(0), logits, cache, kv_mask, key, done, out, logps)
        carry = jax.lax.while_loop(cond, body, carry)
        return carry[6], carry[7]

    return jax.jit(run)


_PROGRAMS: dict[Any, Any] = {}
TRACES: dict[str, int] = {"count": 0}  # how many times a sampling program was traced (compiled)


def generate(model: Decoder, prompts: Sequence[Sequence[int]], *, num_generations: int = 1,
             max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, min_p: float | None = None,
             eos_ids: Sequence[int], pad_id: int = 0, seed: int = 0) -> Generation:
    """Samples ``num_generations`` completions of each prompt (token id lists).

    Args:
      model: The decoder.
      prompts: Token ids of each prompt (no padding).
      num_generations: Completions per prompt (GRPO's group size).
      max_new_tokens: Most tokens per completion.
      temperature: ``0`` for greedy; else the softmax temperature.
      top_k: Sample among the ``top_k`` likeliest tokens only (``None``: all).
      top_p: Sample from the smallest set of likeliest tokens whose probability reaches
        ``top_p`` (``None``: all).
      min_p: Sample among the tokens of probability at least ``min_p`` times the likeliest
        one's (``None``: all).
      eos_ids: Token ids that end a completion (kept in it, with mask 1).
      pad_id: Id written after the end.
      seed: PRNG seed.

    Returns:
      A :class:`Generation`. The compiled program is cached per ``(rows, prompt length rounded
      up to PROMPT_BUCKET, max_new_tokens, sampling settings)``: calls with prompts of other
      lengths in the same bucket do not recompile.
    """
    _check(prompts, num_generations, max_new_tokens, temperature, eos_ids)
    trunc = Truncation(top_k=top_k, top_p=top_p, min_p=min_p)  # ValueError naming the option
    rows = [list(map(int, p)) for p in prompts for _ in range(num_generations)]
    context = model.config.max_position_embeddings
    longest = max(len(r) for r in rows)
    if longest + max_new_tokens > context:  # no cap of our own: the model's context is the limit
        raise ValueError(f"max_new_tokens={max_new_tokens} after a prompt of {longest} tokens "
                         f"needs {longest + max_new_tokens} positions; the model's "
                         f"max_position_embeddings is {context}")
    width = -(-longest // PROMPT_BUCKET) * PROMPT_BUCKET
    prompt = np.full((len(rows), width), pad_id, np.int32)
    prompt_mask = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        prompt[i, width - len(r):] = r
        prompt_mask[i, width - len(r):] = 1
    graphdef, state = nnx.split(model)
    key = (graphdef, max_new_tokens, float(temperature), trunc,
           tuple(int(e) for e in eos_ids), int(pad_id))
    if key not in _PROGRAMS:
        _PROGRAMS[key] = _program(*key)
    ids, logps = _PROGRAMS[key](state, jnp.asarray(prompt), jnp.asarray(prompt_mask),
                                jax.random.PRNGKey(seed))
    ids, logps = np.asarray(ids), np.asarray(logps)
    ended = np.isin(ids, np.asarray(list(eos_ids)))
    # mask: 1 up to and including the first end token of each row
    after_end = np.cumsum(ended, axis=1) - ended > 0
    mask = (~after_end).astype(np.int32)
    return Generation(prompt, prompt_mask, np.where(mask == 1, ids, pad_id), mask,
                      np.where(mask == 1, logps, 0.0).astype(np.float32))
