"""The trainer's update run on the device: one loss arm's step time, device peak and first step.

    python3 -m grpo_kernels.proof.gpu_train_step --arm logits-reference  # Qwen2.5-1.5B, 4 layers
    python3 -m grpo_kernels.proof.gpu_train_step --arm fused-xla-vocab --layers 8
    python3 -m grpo_kernels.proof.gpu_train_step --arm fused-xla --model tiny  # any backend

The program is the one ``benchmarks/tpu_compile.py --op train-step`` (source tree) compiles
for a TPU:
``rl.policy.make_programs``' gradient of one micro-batch, jitted as ``grpo-kernels train``
runs it (the decoder's forward and backward over ``--rows`` rows of ``--prompt`` prompt and
``--completion`` completion tokens, then the loss with beta 0.04 against given reference
log-probs). Here it runs, on random weights (``models.decoder.Decoder`` of the ``--model``
shape, its first ``--layers`` layers, the whole vocabulary and head, bf16 parameters and
compute) and a random micro-batch (left-padded prompts, completions of random lengths), both
drawn from ``--seed`` alone, so every arm's process sees the same numbers. Arms
(``<head>-<impl>``, with the options the trainer hands the loss, ``rl.kernel.resolve``):

- ``logits-reference``, ``logits-xla``: the ``[N, C, V]`` logits, then ``grpo_loss``;
- ``logits-pallas``: the same through the Pallas kernels, dlogits written over the logits
  (``alias_logits``, the trainer's default);
- ``fused-xla``: ``grpo_loss_from_hidden``, its default options (``dW`` summed over token
  chunks in a float32 accumulator); ``fused-xla-chunk2048``: chunks of 2,048 tokens
  (``LmHeadBlockSizes(chunk_tokens=2048)``, twice the GPU's planned 1,024 at this vocabulary);
  ``fused-xla-vocab``: ``LmHeadBlockSizes(dweight="vocab")``;
- ``fused-pallas``: the fused head's Pallas kernels, which are TPU kernels: on any other
  backend the arm is skipped with that reason (exit 3).

One arm per process: the device's peak (``memory_stats()["peak_bytes_in_use"]``, which a process
cannot reset) is then the arm's own, the parameters and micro-batch included. Prints one JSON
line: median milliseconds of a call waited for alone and of calls back to back
(``cli.bench.pipelined_ms``, as a training loop runs them), the device's bytes in use before
the first step and its peak, XLA's plan (``memory_analysis()``), and the first step's loss and
gradient norm (float32 global norm over every parameter's gradient).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from grpo_kernels.proof import shapes  # noqa: E402
from grpo_kernels.proof.timing import median_ms  # noqa: E402

MODELS = shapes.RUN_MODELS  # the published shapes and a tiny one for dry runs and tests
# arm -> (loss.head, loss.impl, loss.kernel entry)
ARMS = {"logits-reference": ("logits", "reference", None),
        "logits-xla": ("logits", "xla", None),
        "logits-pallas": ("logits", "pallas", None),  # alias_logits: the trainer's default
        "fused-xla": ("fused", "xla", None),
        "fused-xla-chunk2048": ("fused", "xla", {"chunk_tokens": 2048}),
        "fused-xla-vocab": ("fused", "xla", {"dweight": "vocab"}),
        "fused-pallas": ("fused", "pallas", None)}
SKIPPED = 3  # the proof's exit code for a phase this backend cannot run, with its reason


def step_parser(doc: str, arms: list[str], arm_help: str) -> argparse.ArgumentParser:
    """The arguments of a step program (this one's and ``gpu_tunix_step``'s): ``--arm`` of
    ``arms``, the model shape, the micro-batch, the timing and the compile cache; ``doc``: the
    program's docstring (its first paragraph the description, from its third on the epilog)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=doc.split("\n\n", 2)[2])
    p.add_argument("--arm", choices=arms, required=True, help=arm_help)
    p.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-1.5b",
                   help="the model's shape (default: qwen2.5-1.5b)")
    p.add_argument("--layers", type=int, default=4,
                   help="decoder layers kept, the first N (default: 4)")
    p.add_argument("--rows", type=int, default=8, help="rows of the micro-batch (default: 8)")
    p.add_argument("--prompt", type=int, default=256, help="prompt width P (default: 256)")
    p.add_argument("--completion", type=int, default=1024,
                   help="completion tokens C (default: 1024)")
    p.add_argument("--iters", type=int, default=5,
                   help="timed calls, each waited for; also the back-to-back run's length "
                   "(default: 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="weights and batch (default: 0)")
    p.add_argument("--compile-cache", metavar="DIR",
                   help="JAX's persistent compilation cache: run twice with the same DIR and "
                   "the second run's peak holds no compile-time allocation")
    return p


def parse_step_args(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``p``'s arguments (:func:`step_parser`), checked: a bad one exits through ``p.error``
    naming it; ``--compile-cache`` takes effect."""
    args = p.parse_args(argv)
    use_compile_cache(args.compile_cache)
    try:
        shapes.check_at_least_one(args, ("rows", "prompt", "completion", "iters"))
        if args.warmup < 0:
            raise ValueError(f"--warmup must be at least 0, got {args.warmup}")
        shapes.model_config(args.model, args.layers, MODELS)
    except ValueError as e:
        p.error(str(e))
    return args


def parse_args(argv=None) -> argparse.Namespace:
    return parse_step_args(step_parser(__doc__, list(ARMS), "the loss arm"), argv)


def micro_batch(seed: int, rows: int, prompt: int, completion: int, vocab: int
                ) -> dict[str, np.ndarray | None]:
    """A trainer micro-batch of random tokens: prompts left-padded to ``prompt`` (lengths in
    ``[prompt / 2, prompt]``), completions of lengths in ``[completion / 2, completion]``,
    standard-normal advantages and reference log-probs near ``-log(vocab)``."""
    rng = np.random.default_rng([seed, 1])
    ids = rng.integers(1, vocab, (rows, prompt + completion), dtype=np.int32)
    attention = np.ones_like(ids)
    mask = np.zeros((rows, completion), np.int32)
    for r in range(rows):
        attention[r, :prompt - int(rng.integers(max(prompt // 2, 1), prompt + 1))] = 0
        mask[r, :int(rng.integers(max(completion // 2, 1), completion + 1))] = 1
    ids[:, :prompt] *= attention[:, :prompt]
    attention[:, prompt:] = mask
    return {"ids": ids, "attention": attention, "mask": mask,
            "advantages": rng.standard_normal(rows).astype(np.float32),
            "old_logps": None,
            # about what a random model gives, so the KL term stays of order one
            "ref_logps": (-np.log(vocab) + 0.1 * rng.standard_normal((rows, completion))
                          ).astype(np.float32),
            "sampler_logps": None}


def use_compile_cache(path: str | None) -> None:
    """Has JAX keep every compiled program in ``path`` (its persistent cache) and read it back
    there. A second process with the same ``path`` then loads the program instead of compiling
    it, so its device peak holds no compile-time allocation (XLA:GPU's autotuner runs candidate
    kernels on buffers of its own while compiling, which a process's peak keeps)."""
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def global_norm(tree) -> jax.Array:
    """The float32 global norm of every leaf of ``tree``."""
    leaves = jax.tree.leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def measure(step, args: tuple, iters: int, warmup: int) -> dict:
    """Compiles ``step`` (jitted) at ``args``, runs it: compile seconds, XLA's plan, the first
    call's result (returned under ``"first"``), median ms alone and back to back, and the
    device's bytes in use before the first call and its peak (None where the backend reports
    no memory_stats)."""
    from grpo_kernels.cli.bench import pipelined_ms

    dev = jax.devices()[0]
    stats = dev.memory_stats()
    t0 = time.perf_counter()
    compiled = step.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    before = stats and dev.memory_stats()["bytes_in_use"]
    compile_peak = stats and dev.memory_stats()["peak_bytes_in_use"]
    first = jax.block_until_ready(compiled(*args))
    ms = median_ms(lambda: compiled(*args), iters, max(warmup - 1, 0))
    back = pipelined_ms(lambda: compiled(*args), iters, rounds=2)
    return {"compile_s": round(compile_s, 2), "median_ms": ms, "pipelined_ms": back,
            "argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
            "temp_bytes": mem.temp_size_in_bytes,
            "bytes_in_use_before": before, "peak_after_compile": compile_peak,
            "peak_bytes_in_use": stats and dev.memory_stats()["peak_bytes_in_use"],
            "first": first}


def run(args: argparse.Namespace) -> dict:
    from flax import nnx

    from grpo_kernels.config import GRPOLossConfig
    from grpo_kernels.models.decoder import Decoder
    from grpo_kernels.rl.kernel import resolve
    from grpo_kernels.rl.policy import make_programs

    head, impl, entry = ARMS[args.arm]
    # as the trainer resolves it (a fused-pallas arm off TPU raises ValueError here)
    impl, options = resolve(head, impl, {} if entry is None else {f"{head}-{impl}": entry})
    cfg = shapes.model_config(args.model, args.layers, MODELS)
    graphdef, state = nnx.split(Decoder(cfg, nnx.Rngs(args.seed)))
    grad_fn, _ = make_programs(graphdef, head=head, impl=impl,
                               config=GRPOLossConfig(beta=0.04), prompt_width=args.prompt,
                               options=options)
    mb = micro_batch(args.seed, args.rows, args.prompt, args.completion, cfg.vocab_size)
    mb = {k: None if v is None else jnp.asarray(v) for k, v in mb.items()}
    num_items = jnp.asarray(float(mb["mask"].sum()), jnp.float32)
    r = measure(jax.jit(grad_fn), (state, mb, jnp.float32(1.0), num_items), args.iters,
                args.warmup)
    (loss, metrics), grads = r.pop("first")
    n = args.rows * args.completion
    return {"op": "train-step", "arm": args.arm, "head": head, "impl": impl,
            "options": None if options is None else repr(options),
            "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
            "model": args.model, "layers": args.layers, "rows": args.rows,
            "prompt": args.prompt, "completion": args.completion, "vocab": cfg.vocab_size,
            "hidden": cfg.hidden_size, "logits_f32_bytes": n * cfg.vocab_size * 4,
            "loss": float(loss), "grad_norm": float(global_norm(grads)),
            "kl": float(metrics["kl"]), **r}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        row = run(args)
    except ValueError as e:
        if args.arm == "fused-pallas":
            print(f"gpu_train_step: skipped: {e}", file=sys.stderr)
            return SKIPPED
        raise
    print(json.dumps(row), flush=True)
    finite = np.isfinite(row["loss"]) and np.isfinite(row["grad_norm"])
    if not finite:
        print(f"gpu_train_step: non-finite first step (loss {row['loss']}, gradient norm "
              f"{row['grad_norm']})", file=sys.stderr)
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
