"""Planned temporaries of a tunix GRPO iteration through the LM head: tunix's own against ours.

    python benchmarks/tunix_memory.py                       # both heads, T = 8,192 and 32,768
    python benchmarks/tunix_memory.py --prompt 128 2048     # also with a 2,048-token prompt
    python benchmarks/tunix_memory.py --hidden 2048 --tokens 8192 --json out.json

Compile-only (nothing of model size is allocated): for each head shape a tunix Qwen3 with the
real embedder, final norm and head of Qwen3-1.7B (H=2048, tied) or Qwen3-8B (H=4096, untied)
but no decoder layers, so what is measured is the head and the loss, not attention. One
sequence: a 128-token prompt and T completion tokens, bf16 parameters and compute. The step is
`jit(value_and_grad)` of the policy loss w.r.t. the parameters, as tunix's trainer
differentiates it, except an untied input embedding: its gradient is the same scatter in every
path and not part of the head (a tied head's weights are the embedding, so there it stays).
The figure is XLA's plan, `memory_analysis().temp_size_in_bytes`, on this CPU's backend.

Contenders of the actor update: tunix's own "grpo"; our registered "grpo_kernels_fused"
(default options: the weight gradient by vocabulary blocks, `LmHeadBlockSizes(dweight="vocab")`);
and the same with `LmHeadBlockSizes()`, the op's faster default, whose float32 [H, V]
accumulator sums the weight gradient over token chunks.

The log-prob pass (the reference model's, whenever beta != 0, and the old policy's, whenever a
batch is reused: both `tunix.rl.common.compute_per_token_logps`, forward only, jitted as tunix
jits it): tunix's own, and ours bound in its place by
`grpo_kernels.integrations.tunix.patch_log_probs` (`log_probs_function()`). The iteration's peak
is the largest of the two passes and the update (rollout aside): tunix's with its own three,
ours with the patched passes and `grpo_kernels_fused`.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from grpo_kernels.rl.run_dir import write_json

PROMPT = 128
SHAPES = {2048: ("Qwen3-1.7B", True), 4096: ("Qwen3-8B", False)}


def _contenders() -> dict[str, Any]:
    import functools

    from tunix.rl import function_registry

    from grpo_kernels import LmHeadBlockSizes
    from grpo_kernels.integrations import tunix as ours

    return {"grpo": function_registry.get_policy_loss_fn("grpo"),
            "grpo_kernels_fused": function_registry.get_policy_loss_fn("grpo_kernels_fused"),
            "grpo_kernels_fused, dweight=tokens": functools.partial(
                ours.fused_policy_loss, impl="auto", options=LmHeadBlockSizes())}


def _head_model(hidden: int, vocab: int):
    """An abstract tunix Qwen3 with the head of the shape ``hidden`` and no decoder layers."""
    import jax.numpy as jnp
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3

    tied = SHAPES.get(hidden, ("", True))[1]
    config = qwen3.ModelConfig(
        num_layers=0, vocab_size=vocab, embed_dim=hidden, hidden_dim=4 * hidden, num_heads=16,
        head_dim=128, num_kv_heads=8, rope_theta=1_000_000, norm_eps=1e-6,
        use_tied_embedding=tied, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    return nnx.eval_shape(lambda: qwen3.Qwen3(config, rngs=nnx.Rngs(0))), tied


def log_prob_bytes(fn: Any, hidden: int, tokens: int, vocab: int, prompt: int) -> int:
    """Planned temp bytes of one log-prob pass ``fn`` (tunix's ``compute_per_token_logps``
    signature) over one sequence of ``prompt`` + ``tokens`` tokens."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    model, _ = _head_model(hidden, vocab)
    graphdef, state = nnx.split(model)
    ids = lambda n: jax.ShapeDtypeStruct((1, n), jnp.int32)  # noqa: E731
    step = jax.jit(lambda st, p, c: fn(graphdef, st, p, c, 0, 1))
    return step.lower(state, ids(prompt), ids(tokens)).compile().memory_analysis(
        ).temp_size_in_bytes


def temp_bytes(loss_fn: Any, hidden: int, tokens: int, vocab: int,
               prompt: int = PROMPT) -> int:
    """Planned temp bytes of one jitted loss-and-gradient step (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.rl import common
    from tunix.rl.grpo.grpo_learner import GRPOConfig

    from grpo_kernels.integrations import tunix as ours

    model, tied = _head_model(hidden, vocab)
    trained = nnx.Param if tied else nnx.All(nnx.Param, nnx.Not(nnx.PathContains("embedder")))
    graphdef, params, rest = nnx.split(model, trained, ...)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    example = common.TrainExample(
        prompt_ids=i32(1, prompt), prompt_mask=i32(1, prompt), completion_ids=i32(1, tokens),
        completion_mask=i32(1, tokens), advantages=f32(1), ref_per_token_logps=f32(1, tokens),
        old_per_token_logps=f32(1, tokens))
    algo = GRPOConfig(num_generations=2, beta=0.04)
    algo.temperature = 1.0  # the learner copies the rollout temperature here

    def loss(p, frozen, ex):
        return ours.differentiated(loss_fn(nnx.merge(graphdef, p, frozen), ex, algo, 0, 1))

    step = jax.jit(jax.value_and_grad(loss))
    return step.lower(params, rest, example).compile().memory_analysis().temp_size_in_bytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096],
                   help="head widths H (2048: Qwen3-1.7B, tied; 4096: Qwen3-8B, untied)")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768],
                   help="completion tokens T of the one sequence")
    p.add_argument("--prompt", type=int, nargs="+", default=[PROMPT],
                   help=f"prompt tokens P (default: {PROMPT})")
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    for name, value in (("--vocab", args.vocab), *(("--hidden", h) for h in args.hidden),
                        *(("--tokens", t) for t in args.tokens),
                        *(("--prompt", n) for n in args.prompt)):
        if value <= 0:
            p.error(f"{name} must be positive, got {value}")

    from tunix.rl import common

    from grpo_kernels.integrations import tunix as ours  # registers our two losses

    contenders = _contenders()
    passes = {"logps tunix": common.compute_per_token_logps,
              "logps ours": ours.log_probs_function()}
    names = [*contenders, *passes]
    rows = []
    print("| model head | H | P | T | " + " | ".join(f"`{n}`" for n in names)
          + " | update ratios to `grpo` | log-prob pass ratio | iteration peak ratio |\n"
          "|---|---|---|---|" + "---|" * (len(names) + 3))
    for hidden in args.hidden:
        for prompt in args.prompt:
            for tokens in args.tokens:
                row = {"hidden": hidden, "tokens": tokens, "vocab": args.vocab,
                       "prompt": prompt}
                for name in names:
                    start = time.perf_counter()
                    row[name] = (temp_bytes(contenders[name], hidden, tokens, args.vocab, prompt)
                                 if name in contenders else
                                 log_prob_bytes(passes[name], hidden, tokens, args.vocab,
                                                prompt))
                    print(f"  planned {name} H={hidden} P={prompt} T={tokens} in "
                          f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
                row["iteration tunix"] = max(row["grpo"], row["logps tunix"])
                row["iteration ours"] = max(row["grpo_kernels_fused"], row["logps ours"])
                rows.append(row)
                cells = " | ".join(f"{row[n] / 2**30:.2f} GiB" for n in names)
                ratios = " / ".join(f"{row[n] / row['grpo']:.3f}" for n in contenders
                                    if n != "grpo")
                label = SHAPES.get(hidden, ("custom", True))[0]
                print(f"| {label} | {hidden} | {prompt:,} | {tokens:,} | {cells} | {ratios} | "
                      f"{row['logps ours'] / row['logps tunix']:.3f} | "
                      f"{row['iteration ours'] / row['iteration tunix']:.3f} |", flush=True)
    if args.json:  # whole or not at all: a crash leaves no half-written file
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
