"""The GPU kernels' two layouts, ``rows`` and ``aligned``, timed in one process (a proof phase).

    python3 benchmarks/gpu_layouts.py                       # the issue's shapes, on a GPU
    python3 benchmarks/gpu_layouts.py --tilings 4096x4,8192x8,16384x8   # the tiling sweep
    python3 benchmarks/gpu_layouts.py --shapes 16x300 --block-vocab 128 --iters 2   # a CPU smoke

For each ``N x V`` (bf16 logits, the default loss with old and reference log-probs), and each
layout (``PallasOptions(gpu_layout=...)``): the statistics kernels alone, the gradient kernels
alone, and the whole ``value_and_grad`` step; then the ``xla`` step and XLA's ``z + 1`` (the
gradient's bytes: one read, one write) as yardsticks. The aligned layout's loss and dlogits
are compared with the rows layout's in the same run.

With ``--tilings`` (vocabulary tile x warps per program), the tiling sweep instead: the aligned
layout's two kernels at ``pallas_gpu.plan_blocks``'s tiling (the row named ``aligned``) and at
each given one (``aligned_<tile>x<warps>``), each one's dlogits compared with the planner's.

Everything alternates over ``--rounds`` rounds and each figure is the mean of its rounds'
medians. One JSON line per measurement; off a GPU the kernels are interpreted (numbers only,
no meaningful times).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import jax
import jax.numpy as jnp
from timing import median_ms

from grpo_kernels import GRPOLossConfig, PallasBlockSizes, PallasOptions, grpo_loss
from grpo_kernels.ops.logits_loss import pallas_gpu
from grpo_kernels.ops.logits_loss.inputs import random_inputs

LAYOUTS = pallas_gpu.LAYOUTS
SHAPES = "2048x151643,4096x151643,2048x151936"


def _pairs(text: str) -> list[tuple[int, ...]] | None:
    """``"AxB,CxD"`` -> ``[(A, B), (C, D)]`` (empty parts skipped); None when a number does
    not parse. The callers check the pairs' lengths and values."""
    try:
        return [tuple(int(x) for x in part.split("x")) for part in text.split(",") if part]
    except ValueError:
        return None


def shape_list(text: str) -> list[tuple[int, int]]:
    """``"NxV,NxV"`` -> ``[(N, V), ...]``."""
    out = _pairs(text)
    if not out or any(len(s) != 2 or min(s) < 1 for s in out):
        raise argparse.ArgumentTypeError(f"--shapes wants N x V pairs like 2048x151643,"
                                         f"4096x151643, got {text!r}")
    return out


def tiling_list(text: str) -> list[tuple[int, int]]:
    """``"BVxW,BVxW"`` -> ``[(block_vocab, num_warps), ...]`` (empty text: none)."""
    out = _pairs(text)
    if out is None or any(len(t) != 2 or t[0] < 1 or t[0] & (t[0] - 1)
                          or t[1] not in (1, 2, 4, 8, 16) for t in out):
        raise argparse.ArgumentTypeError(
            f"--tilings wants vocabulary tile x warps pairs (a power of two x 1, 2, 4, 8 or "
            f"16) like 4096x4,8192x8, got {text!r}")
    return out


def _interpret() -> bool:
    """Whether the kernels run interpreted: exactly on CPU, the library's rule."""
    return bool(PallasOptions(kernel="gpu").resolved_interpret())


def _rel(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def _kernels(z, ids, coef, blocks, interpret: bool) -> dict:
    """The jitted statistics and gradient kernels of one tiling."""
    stats = jax.jit(lambda z: pallas_gpu.row_statistics(z, ids, 1.0, blocks,
                                                        interpret=interpret))
    lse = stats(z)[1]
    grad = jax.jit(lambda z: pallas_gpu.logits_gradient(z, ids, lse, coef, 1.0, blocks,
                                                        interpret=interpret))
    return {"stats": stats, "grad": grad}


def _times(fns: dict, args: dict, iters: int, rounds: int) -> dict:
    """``{(name, what): [ms per round]}``, the functions alternating within each round."""
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for name, kernels in fns.items():
            for what, f in kernels.items():
                ms = median_ms(lambda f=f, a=args[what]: f(*a), iters, 2)
                times.setdefault((name, what), []).append(ms)
    return times


def _row(n: int, vocab: int, name: str, kernels: dict, times: dict, **extra) -> dict:
    row = {"n": n, "vocab": vocab, "layout": name, **extra, "backend": jax.default_backend(),
           "interpret": _interpret()}
    for what in kernels:
        row[f"{what}_ms"] = statistics.mean(times[(name, what)])
        row[f"{what}_ms_rounds"] = times[(name, what)]
    return row


def _inputs(n: int, vocab: int):
    cfg = GRPOLossConfig()
    inp = random_inputs(n + vocab, 1, n, vocab, jnp.bfloat16, cfg)
    coef = jax.random.normal(jax.random.PRNGKey(1), (n,), jnp.float32)
    return cfg, inp, inp.logits.reshape(n, vocab), inp.ids.reshape(n), coef


def measure_tilings(n: int, vocab: int, tilings: list[tuple[int, int]], iters: int,
                    rounds: int) -> list[dict]:
    """The tiling sweep's JSON rows of one shape."""
    _, _, z, ids, coef = _inputs(n, vocab)
    interpret = _interpret()
    blocks = {"aligned": pallas_gpu.plan_blocks(vocab, None, "aligned")}
    blocks.update({f"aligned_{bv}x{w}": pallas_gpu.GpuBlocks(bv, w, "aligned")
                   for bv, w in tilings})
    fns = {name: _kernels(z, ids, coef, b, interpret) for name, b in blocks.items()}
    times = _times(fns, {"stats": (z,), "grad": (z,)}, iters, rounds)
    planned = fns["aligned"]["grad"](z)
    return [_row(n, vocab, name, fns[name], times, block_vocab=b.block_vocab,
                 num_warps=b.num_warps,
                 dlogits_max_rel_diff_to_planned=_rel(fns[name]["grad"](z), planned))
            for name, b in blocks.items()]


def measure(n: int, vocab: int, block_vocab: int | None, iters: int, rounds: int):
    """The layout A/B's JSON rows of one shape."""
    cfg, inp, z, ids, coef = _inputs(n, vocab)
    interpret = _interpret()
    fns, outs = {}, {}
    for layout in LAYOUTS:
        blocks = pallas_gpu.plan_blocks(vocab, block_vocab, layout)
        opts = PallasOptions(kernel="gpu", gpu_layout=layout,
                             blocks=PallasBlockSizes(block_vocab=block_vocab))
        step = jax.jit(jax.value_and_grad(lambda z, o=opts: grpo_loss(
            z, inp.ids, inp.mask, inp.advantages, config=cfg, impl="pallas", options=o,
            **inp.kwargs())[0]))
        fns[layout] = {**_kernels(z, ids, coef, blocks, interpret), "step": step}
        outs[layout] = step(inp.logits)
    fns["xla"] = {"step": jax.jit(jax.value_and_grad(lambda z: grpo_loss(
        z, inp.ids, inp.mask, inp.advantages, config=cfg, impl="xla", **inp.kwargs())[0]))}
    fns["xla_copy"] = {"step": jax.jit(lambda z: z + jnp.asarray(1, z.dtype))}
    times = _times(fns, {"stats": (z,), "grad": (z,), "step": (inp.logits,)}, iters, rounds)
    nbytes = z.size * z.dtype.itemsize
    (loss_r, dz_r), (loss_a, dz_a) = outs["rows"], outs["aligned"]
    rows = []
    for name, kernels in fns.items():
        row = _row(n, vocab, name, kernels, times, block_vocab=block_vocab)
        if name in LAYOUTS or name == "xla":
            row["step_bytes_per_s"] = 3 * nbytes / (row["step_ms"] * 1e-3)
        if name == "aligned":
            row["loss_rel_diff_to_rows"] = _rel(loss_a, loss_r)
            row["dlogits_max_rel_diff_to_rows"] = _rel(dz_a, dz_r)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=shape_list, default=shape_list(SHAPES),
                   help=f"comma list of N x V (default {SHAPES})")
    p.add_argument("--block-vocab", type=int, default=None,
                   help="the kernels' vocabulary tile (default: pallas_gpu.plan_blocks)")
    p.add_argument("--tilings", type=tiling_list, default=[],
                   help="the tiling sweep instead of the layout A/B: the aligned layout's "
                   "kernels at these tilings (tile x warps, e.g. 4096x4,8192x8) and the "
                   "planner's")
    p.add_argument("--iters", type=int, default=20, help="timed calls per median")
    p.add_argument("--rounds", type=int, default=2, help="rounds the layouts alternate over")
    args = p.parse_args(argv)
    if args.iters < 1 or args.rounds < 1:
        p.error(f"--iters and --rounds must be >= 1, got {args.iters} and {args.rounds}")
    if args.tilings and args.block_vocab:
        p.error("--block-vocab is the layout A/B's; the tiling sweep takes --tilings only")
    worst = 0.0
    for n, vocab in args.shapes:
        rows = (measure_tilings(n, vocab, args.tilings, args.iters, args.rounds)
                if args.tilings else measure(n, vocab, args.block_vocab, args.iters, args.rounds))
        for row in rows:
            worst = max(worst, *(row.get(k, 0.0) for k in (
                "dlogits_max_rel_diff_to_rows", "loss_rel_diff_to_rows",
                "dlogits_max_rel_diff_to_planned")))
            print(json.dumps(row), flush=True)
    # Layouts and tilings compute the same thing; a difference beyond rounding is a bug.
    if not worst <= 1e-2:
        print(f"a layout or tiling differs from the others: {worst:.3g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
