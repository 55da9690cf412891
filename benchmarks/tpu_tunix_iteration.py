"""A tunix GRPO iteration's loss work compiled for a TPU, tunix's own chunking beside ours.

    PYTHONPATH=.venv/tunix-head python3 benchmarks/tpu_tunix_iteration.py \\
        --heads qwen3-1.7b,qwen3-8b --time 8192,32768 --generations v5e,v6e

What a tunix user on a TPU chooses between: tunix's development head (``make
test-tunix-head`` installs it in ``.venv/tunix-head``) with its log-prob chunking
(``compute_logps_chunk_size``, ``--chunks``; 0 is its default, unchunked) and ours with no
options (``grpo_kernels_fused`` as the adapter registers it; ``patch_log_probs``' pass). Both
passes of an iteration:

- ``update``: ``jit(value_and_grad)`` of tunix's ``grpo_loss_fn`` (or ours) with respect to
  the model's parameters, as tunix's trainer differentiates it;
- ``logps``: the forward-only log-prob pass (the reference model's and the old policy's),
  tunix's ``compute_per_token_logps`` (or ours).

The model is a tunix ``Qwen3`` with the real head of Qwen3-1.7B (tied to the embedding,
H = 2,048) or Qwen3-8B (untied, H = 4,096), V = 151,936, bf16, and no decoder layers, so the
plan is the loss's and the head's; one sequence of ``--prompt`` + ``--time`` tokens. Each row:
the compile's planned temporaries (``memory_analysis()``); the flops and HBM bytes of the
optimized program with every loop counted as often as it runs (``hlo_cost.loop_costs``; XLA's
``cost_analysis()``, which counts a loop's body once, beside them as ``xla_flops`` /
``xla_bytes``), and the roofline time they give at the generation's published peak figures
(:data:`PEAKS`). The last row of each (generation, head, T, pass) is a summary: ours over
tunix's default and over its best chunk setting among those above 0 (the lowest
temporaries), in temporaries and in roofline time. ``--ours-chunk-bytes`` takes a list: one
arm of ours per budget (``ours-cbN``), for choosing a default. Nothing runs on a TPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hlo_cost import loop_costs  # noqa: E402
from tpu_compile import (PAD, EOS, _list, _spec, emit, topology, tunix_update,  # noqa: E402
                         use_libtpu)

# Published peak figures per chip (Google Cloud's TPU pages, 2026): dense bf16 FLOP/s and HBM
# bytes/s. v5e: 197 TFLOP/s, 819 GB/s; v6e (Trillium): 918 TFLOP/s, 1,640 GB/s.
PEAKS = {"v5e": (197e12, 819e9), "v6e": (918e12, 1640e9)}
# The heads: tunix's Qwen3 preset whose head each is.
HEADS = {"qwen3-1.7b": "qwen3_1p7b", "qwen3-8b": "qwen3_8b"}
PASSES = ("update", "logps")


def head_model(head: str):
    """tunix's Qwen3 of ``head``'s preset with no decoder layers, bf16 parameters and compute
    (the presets' default is float32), abstract."""
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3

    config = dataclasses.replace(getattr(qwen3.ModelConfig, HEADS[head])(), num_layers=0,
                                 dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    return nnx.eval_shape(lambda: qwen3.Qwen3(config, rngs=nnx.Rngs(0)))


def roofline_s(flops: float | None, nbytes: float | None, generation: str) -> float | None:
    """``max(flops / peak FLOP/s, bytes / peak bytes/s)`` with :data:`PEAKS`: the time no
    program doing that work can beat on the chip."""
    if flops is None or nbytes is None:
        return None
    peak_flops, peak_bw = PEAKS[generation]
    return max(flops / peak_flops, nbytes / peak_bw)


def ours_options(chunk_bytes: int | None, dweight: str | None):
    """``--ours-chunk-bytes`` / ``--ours-dweight`` as the ``xla`` head's options, or None
    (ours with no options: the adapter's choice). Without ``dweight`` it is the adapter's
    ``"vocab"`` (:func:`grpo_kernels.integrations.tunix.fused_options`), so that a chunk budget
    alone does not bring back the float32 ``[H, V]`` accumulator."""
    if chunk_bytes is None and dweight is None:
        return None
    from grpo_kernels.ops.lm_head_loss.xla_plan import LmHeadBlockSizes
    return LmHeadBlockSizes(chunk_bytes=chunk_bytes, dweight=dweight or "vocab")


def program(pass_: str, arm: str, model, device, prompt: int, time: int, options=None):
    """``(jitted step, abstract args)`` of ``arm``: ``tunix-chunkN``, ours (``ours``,
    ``ours-cbN``; on the ``xla`` head with ``options`` where given), or ``no-head``, the model
    without its head (the update of a loss of the completion's hidden states alone, the
    forward pass to them: ``proof.gpu_tunix_step``'s floor under every loss); the update is
    :func:`tpu_compile.tunix_update`'s program, on one row."""
    from flax import nnx
    from tunix.rl import algo_core, common

    from grpo_kernels.integrations import tunix as ours
    from grpo_kernels.proof import gpu_tunix_step
    tunix = arm.startswith("tunix-chunk")
    chunk = int(arm.removeprefix("tunix-chunk")) if tunix else 0
    given = {} if options is None else {"impl": "xla", "options": options}
    if pass_ == "update":
        fn = (functools.partial(algo_core.grpo_loss_fn, compute_logps_chunk_size=chunk) if tunix
              else gpu_tunix_step._no_head_loss if arm == "no-head"
              else functools.partial(ours.fused_policy_loss, **given))
        return tunix_update(fn, device, model, 1, prompt, time)
    sh = SingleDeviceSharding(device)
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: _spec(x.shape, x.dtype, sh), state)
    if arm == "no-head":
        step = jax.jit(lambda st, p, c: gpu_tunix_step._completion_hidden(
            nnx.merge(graphdef, st), p, c))
    else:
        fn = (functools.partial(common.compute_per_token_logps, chunk_size=chunk) if tunix
              else ours.log_probs_function(**given))
        step = jax.jit(lambda st, p, c: fn(graphdef, st, p, c, PAD, EOS))
    return step, (state, _spec((1, prompt), jnp.int32, sh), _spec((1, time), jnp.int32, sh))


def compile_row(step, args, generation: str) -> dict:
    """``step`` compiled at ``args``: its planned memory (``memory_analysis()``), its flops and
    bytes with loops counted (:func:`hlo_cost.loop_costs`) and their roofline time, XLA's own
    ``cost_analysis()`` figures, or the compile error's first line."""
    t0 = time.perf_counter()
    try:
        compiled = step.lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - a compile error is this row's result
        return {"ok": False, "error": str(e).strip().splitlines()[0][:300]}
    mem, c = compiled.memory_analysis(), compiled.cost_analysis()
    c = (c[0] if isinstance(c, (list, tuple)) else c) or {}
    counted = loop_costs(compiled.as_text())
    roof = roofline_s(counted.flops, counted.bytes_accessed, generation)
    return {"ok": True, "compile_s": round(time.perf_counter() - t0, 2),
            "argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
            "temp_bytes": mem.temp_size_in_bytes, "flops": counted.flops,
            "bytes_accessed": counted.bytes_accessed, "loops_not_counted": counted.unknown_loops,
            "xla_flops": c.get("flops"), "xla_bytes": c.get("bytes accessed"),
            "roofline_ms": None if roof is None else 1e3 * roof}


def rows(args: argparse.Namespace):
    """One row per (generation, head, T, pass, arm), then each group's summary."""
    budgets = args.ours_chunk_bytes or [None]
    ours_arms = {("ours" if b is None or len(budgets) == 1 else f"ours-cb{b}"): b
                 for b in budgets}
    arms = [f"tunix-chunk{c}" for c in args.chunks] + list(ours_arms) + (
        ["no-head"] if args.floor else [])
    models = {head: head_model(head) for head in args.heads}
    for gen, head, t, pass_ in itertools.product(args.generations, args.heads, args.time,
                                                 args.passes):
        _, devices = topology(gen)
        group = {}
        for arm in arms:
            step, a = program(pass_, arm, models[head], devices[0], args.prompt, t,
                              ours_options(ours_arms.get(arm), args.ours_dweight))
            row = {"op": "tunix-iteration", "generation": gen, "head": head, "time": t,
                   "prompt": args.prompt, "pass": pass_, "arm": arm,
                   **compile_row(step, a, gen)}
            if row["ok"]:
                group[arm] = row
            yield row
        yield summary(gen, head, t, pass_, group)


def summary(gen: str, head: str, t: int, pass_: str, group: dict) -> dict:
    """Each of ours over tunix's default (chunk 0) and over its best chunked setting (the
    lowest temporaries among chunks above 0): temporaries and roofline time."""
    default = group.get("tunix-chunk0")
    chunked = {a: r for a, r in group.items()
               if a.startswith("tunix-chunk") and a != "tunix-chunk0"}
    best = min(chunked, key=lambda a: chunked[a]["temp_bytes"]) if chunked else None
    ours = {a: r for a, r in group.items() if a.startswith("ours")}
    out = {"op": "tunix-iteration-summary", "generation": gen, "head": head, "time": t,
           "pass": pass_, "ok": bool(ours), "best_chunk": best}
    if "no-head" in group and best is not None:  # what tunix's best plans above the floor
        out["best_over_floor"] = chunked[best]["temp_bytes"] / max(
            group["no-head"]["temp_bytes"], 1)
    for arm, row in ours.items():
        tag = "" if arm == "ours" else f"_{arm}"
        for name, base in (("default", default), ("best", chunked.get(best))):
            if base is None:
                continue
            out[f"temp_over_{name}{tag}"] = row["temp_bytes"] / max(base["temp_bytes"], 1)
            if row.get("roofline_ms") and base.get("roofline_ms"):
                out[f"roofline_over_{name}{tag}"] = row["roofline_ms"] / base["roofline_ms"]
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--heads", type=_list(HEADS), default=list(HEADS),
                   help=f"comma-separated of {','.join(HEADS)} (default: both)")
    p.add_argument("--time", type=_list(kind=int), default=[8192],
                   help="comma-separated completion lengths T (default: 8192)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--chunks", type=_list(kind=int), default=[0, 128, 256, 512, 1024],
                   help="tunix's compute_logps_chunk_size settings (default: 0,128,256,512,1024)")
    p.add_argument("--passes", type=_list(PASSES), default=list(PASSES),
                   help="update, logps or both (default: both)")
    p.add_argument("--generations", type=_list(PEAKS), default=list(PEAKS),
                   help=f"comma-separated of {','.join(PEAKS)} (default: both)")
    p.add_argument("--ours-chunk-bytes", type=_list(kind=int), default=None, metavar="N[,N...]",
                   help="ours on the xla head with LmHeadBlockSizes(chunk_bytes=N), one arm "
                   "per N (default: ours with no options)")
    p.add_argument("--ours-dweight", choices=("tokens", "vocab"), default=None,
                   help="ours on the xla head with this LmHeadBlockSizes.dweight (default: "
                   "ours with no options; with --ours-chunk-bytes alone: vocab, the "
                   "adapter's choice)")
    p.add_argument("--floor", action="store_true",
                   help="also the model without its head (arm no-head): the floor under both")
    p.add_argument("--libtpu", default=None, help="libtpu.so (default: $TPU_LIBRARY_PATH, "
                   "then .venv/libtpu)")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    if args.prompt < 1 or any(t < 1 for t in args.time):
        p.error("--prompt and --time must be at least 1")
    if any(c < 0 for c in args.chunks):
        p.error(f"--chunks must be non-negative, got {args.chunks}")
    if args.ours_chunk_bytes is not None and min(args.ours_chunk_bytes) < 1:
        p.error(f"--ours-chunk-bytes must be at least 1, got {args.ours_chunk_bytes}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        from grpo_kernels.integrations.tunix.offers import chunks_log_probs
        chunked = chunks_log_probs()
    except ImportError as e:
        print(f"tpu_tunix_iteration: needs google-tunix ({e})", file=sys.stderr)
        return 2
    if not chunked:
        print("tpu_tunix_iteration: needs tunix's development head, whose log-prob pass "
              "chunks (make test-tunix-head installs it: PYTHONPATH=.venv/tunix-head)",
              file=sys.stderr)
        return 2
    if not use_libtpu(args.libtpu, "tpu_tunix_iteration"):
        return 2
    return emit(rows(args), args.out)


if __name__ == "__main__":
    sys.exit(main())
