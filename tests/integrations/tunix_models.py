"""Tiny random tunix models and TrainExamples for the integration tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

PAD, EOS = 0, 1
VOCAB = 257  # odd: no tile of any implementation divides it


def tiny_model(family: str, seed: int = 0, tied: bool = False, dtype=jnp.float32,
               softcap: float | None = None, vocab: int = VOCAB):
    """A 2-layer tunix Qwen2 / Qwen3 / Llama3 / Gemma3 / Gemma with random weights (Gemma's
    heads are always tied; ``softcap``: Gemma's ``final_logit_softcap``, as Gemma 2's)."""
    shape = dict(num_layers=2, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8,
                 num_kv_heads=2)
    rngs = nnx.Rngs(seed)
    if family == "gemma3":
        from tunix.models.gemma3 import model as m

        return m.Gemma3(m.ModelConfig(**shape, num_embed=vocab, sliding_window_size=4,
                                      param_dtype=jnp.float32), rngs=rngs)
    if family == "gemma":
        from tunix.models.gemma import model as m

        return m.Gemma(m.ModelConfig(
            **shape, num_embed=vocab, final_logit_softcap=softcap, use_post_attn_norm=True,
            use_post_ffw_norm=True, attention_types=(m.AttentionType.GLOBAL,) * 2), rngs=rngs)
    common = dict(**shape, vocab_size=vocab, rope_theta=10_000, norm_eps=1e-6)
    if family == "qwen3":
        from tunix.models.qwen3 import model as m

        return m.Qwen3(m.ModelConfig(**common, use_tied_embedding=tied, dtype=dtype,
                                     param_dtype=jnp.float32), rngs=rngs)
    if family == "qwen2":
        from tunix.models.qwen2 import model as m

        return m.Qwen2(m.ModelConfig(**common, use_tied_embedding=tied, dtype=dtype,
                                     param_dtype=jnp.float32), rngs=rngs)
    from tunix.models.llama3 import model as m

    return m.Llama3(m.ModelConfig(**common, weight_tying=tied), rngs=rngs)


def train_example(model, seed: int = 0, batch: int = 4, prompt: int = 5, completion: int = 7,
                  sampler: bool = False, ref: bool = True, noise: float = 0.3,
                  vocab: int = VOCAB):
    """A ``TrainExample`` like one GRPO step's: left-padded prompts, right-padded completions
    (one ends at once, one fills the length), advantages ~ N(0, 1), old and reference log-probs
    the model's own plus noise (so the clips and clamps act), sampler weights in [0.2, 2)."""
    from tunix.rl import common

    rng = np.random.default_rng(seed)
    prompt_ids = rng.integers(2, vocab, (batch, prompt))
    for b in range(batch):
        prompt_ids[b, :b % prompt] = PAD
    lengths = np.array([1, completion, *rng.integers(1, completion + 1, batch - 2)])
    completion_ids = rng.integers(2, vocab, (batch, completion))
    mask = (np.arange(completion)[None, :] < lengths[:, None]).astype(np.int32)
    completion_ids = np.where(mask > 0, completion_ids, PAD)
    for b in range(batch):
        if lengths[b] < completion:
            completion_ids[b, lengths[b] - 1] = EOS
    prompt_ids, completion_ids = jnp.asarray(prompt_ids), jnp.asarray(completion_ids)
    graphdef, state = nnx.split(model)
    logps = common.compute_per_token_logps(graphdef, state, prompt_ids, completion_ids, PAD, EOS)
    noise_a = jnp.asarray(rng.normal(size=logps.shape) * noise, jnp.float32)
    noise_b = jnp.asarray(rng.normal(size=logps.shape) * noise, jnp.float32)
    weights = jnp.asarray(rng.uniform(0.2, 2.0, logps.shape), jnp.float32) if sampler else None
    return common.TrainExample(
        prompt_ids=prompt_ids, prompt_mask=(prompt_ids != PAD).astype(jnp.int32),
        completion_ids=completion_ids, completion_mask=jnp.asarray(mask),
        advantages=jnp.asarray(rng.normal(size=batch), jnp.float32),
        ref_per_token_logps=logps + noise_b if ref else None,
        old_per_token_logps=logps + noise_a, sampler_is_weights=weights)


def halved(model):
    """``model`` as an instance of a subclass whose ``__call__`` halves the logits."""
    base = type(model)

    def __call__(self, *args, **kwargs):
        logits, cache = base.__call__(self, *args, **kwargs)
        return logits * 0.5, cache
    model.__class__ = type("HalvedLogits", (base,), {"__call__": __call__})
    return model


def loss_and_grads(loss_fn, model, example, algo_config, jit: bool = True):
    """``(loss, aux, grads)`` of a tunix policy loss w.r.t. every parameter of ``model``."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def f(p):
        m = nnx.merge(graphdef, p, rest)
        return loss_fn(m, example, algo_config, PAD, EOS)

    step = jax.value_and_grad(f, has_aux=True)
    if jit:
        step = jax.jit(step)
    (loss, aux), grads = step(params)
    return loss, aux, grads


def max_rel_err(a, b) -> float:
    """Largest, over the leaves of two pytrees, of max|a - b| / max|b|."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.isfinite(x).all(), "non-finite gradient"
        scale = np.max(np.abs(y))
        worst = max(worst, float(np.max(np.abs(x - y)) / scale) if scale > 0 else
                    float(np.max(np.abs(x))))
    return worst
