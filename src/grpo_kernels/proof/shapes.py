"""The model shapes the proof's programs and the TPU-compile benchmarks build.

Published configs of Qwen2.5 and SmolLM2 as :class:`~grpo_kernels.models.config.ModelConfig`
(:func:`model_config`: the first N layers with the whole vocabulary and head), tiny ones for
dry runs, and the same shapes as tunix models (:func:`tunix_model`, tunix's own Gemma3
presets besides) with the GRPO config the tunix programs share (:func:`algo_config`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

# Qwen2.5 shapes (the published configs): hidden, intermediate, layers, heads, KV heads, head
# dim, vocabulary (the embedding's rows), tied embedding.
MODELS = {"qwen2.5-0.5b": (896, 4864, 24, 14, 2, 64, 151_936, True),
          "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 128, 151_936, True),
          "qwen2.5-3b": (2048, 11008, 36, 16, 2, 128, 151_936, True),
          "qwen2.5-7b": (3584, 18944, 28, 28, 4, 128, 152_064, False),
          # SmolLM2-135M-Instruct (configs/learn.yaml's model): a Llama, no attention bias
          "smollm2-135m": (576, 1536, 30, 9, 3, 64, 49_152, True)}
# MODELS and a tiny shape for dry runs and tests.
RUN_MODELS = {**MODELS, "tiny": (64, 128, 2, 4, 2, 16, 512, True)}

def check_layers(name: str, layers: int, total: int) -> None:
    """ValueError, worded for ``--layers``, unless ``1 <= layers <= total`` (``name``'s)."""
    if not 1 <= layers <= total:
        raise ValueError(f"--layers must be in [1, {total}] for {name}, got {layers}")


def check_at_least_one(args, names: tuple[str, ...]) -> None:
    """ValueError, worded for its flag, for the first of ``names`` (attributes of parsed
    ``args``, each a count such as ``rows``) below 1."""
    for name in names:
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name} must be at least 1, got {value}")


def model_config(name: str, layers: int, models: dict | None = None):
    """The ``ModelConfig`` of shape ``name`` (of ``models``, default :data:`MODELS`), its
    first ``layers`` layers, bf16 parameters and compute."""
    from grpo_kernels.models.config import ModelConfig
    hidden, inter, total, heads, kv, head_dim, vocab, tied = (models or MODELS)[name]
    check_layers(name, layers, total)
    llama = name.startswith("smollm2")
    return ModelConfig(family="llama" if llama else "qwen2", vocab_size=vocab,
                       hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                       attention_bias=not llama, rope_theta=1e5 if llama else 1e4,
                       tie_word_embeddings=tied, param_dtype=jnp.bfloat16,
                       compute_dtype=jnp.bfloat16)


# --model names of tunix's Gemma3 presets (bf16 parameters, vocabulary 262,144).
GEMMA3 = {"gemma3-1b": "gemma3_1b_pt", "gemma3-4b": "gemma3_4b_pt"}

def gemma3_config(name: str, layers: int):
    """tunix's own Gemma3 preset ``name`` (:data:`GEMMA3`), its first ``layers`` layers."""
    from tunix.models.gemma3 import model as gemma3

    c = getattr(gemma3.ModelConfig, GEMMA3[name])()
    check_layers(name, layers, c.num_layers)
    return dataclasses.replace(c, num_layers=layers)


def tunix_config(name: str, layers: int):
    """The config of ``name``'s first ``layers`` layers: a Qwen2.5 shape or a Gemma3 preset."""
    if name in GEMMA3:
        return gemma3_config(name, layers)
    return model_config(name, layers)


def tunix_model(name: str, layers: int, abstract: bool = True, seed: int = 0,
                models: dict | None = None):
    """A tunix model of the shape ``name``, its first ``layers`` layers (a Qwen2 of a Qwen2.5
    shape, of ``models``, default :data:`MODELS`, or tunix's Gemma3 preset), and its
    vocabulary: abstract (``nnx.eval_shape``), or with random weights drawn from ``seed``."""
    from flax import nnx

    build = nnx.eval_shape if abstract else (lambda f: f())
    if name in GEMMA3:
        from tunix.models.gemma3 import model as gemma3

        c = gemma3_config(name, layers)
        return build(lambda: gemma3.Gemma3(c, rngs=nnx.Rngs(seed))), c.num_embed
    from tunix.models.qwen2 import model as qwen2

    c = model_config(name, layers, models)

    config = qwen2.ModelConfig(
        num_layers=layers, vocab_size=c.vocab_size, embed_dim=c.hidden_size,
        hidden_dim=c.intermediate_size, num_heads=c.num_heads, head_dim=c.head_dim,
        num_kv_heads=c.num_kv_heads, rope_theta=1_000_000, norm_eps=1e-6,
        use_tied_embedding=c.tie_word_embeddings, dtype=jnp.bfloat16,
        param_dtype=jnp.bfloat16)
    return build(lambda: qwen2.Qwen2(config, rngs=nnx.Rngs(seed))), c.vocab_size


def algo_config():
    """The GRPO config of every arm: beta 0.04, token-mean, low_var_kl, epsilon 0.2."""
    from tunix.rl.grpo.grpo_learner import GRPOConfig

    config = GRPOConfig(loss_agg_mode="token-mean", kl_loss_mode="low_var_kl", loss_algo="grpo",
                        beta=0.04, epsilon=0.2, num_generations=2)
    config.temperature = 1.0  # tunix's learner copies the rollout's temperature here
    return config
