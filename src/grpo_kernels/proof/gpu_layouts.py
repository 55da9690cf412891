"""The GPU kernels' layouts, ``rows`` and ``aligned``, and the one-pass GPU kernel, timed in
one process (proof phases).

    python3 -m grpo_kernels.proof.gpu_layouts                # the default shapes, on a GPU
    python3 -m grpo_kernels.proof.gpu_layouts --tilings 4096x4,8192x8,16384x8   # tilings
    python3 -m grpo_kernels.proof.gpu_layouts --one-pass-tilings 8192x8x264x1,16384x16x132x2x0
    python3 -m grpo_kernels.proof.gpu_layouts --shapes 16x300 --block-vocab 128 --iters 2  # CPU

For each ``N x V`` (bf16 logits, the default loss with old and reference log-probs), and each
layout (``PallasOptions(gpu_layout=...)``): the statistics kernels alone, the gradient kernels
alone, and the whole ``value_and_grad`` step; the one-pass kernel's step
(``PallasOptions(one_pass=True)``, row ``one_pass``); then the ``xla`` step, XLA's ``z + 1``
(``xla_copy``: the gradient's bytes, one read and one write) and XLA's row max (``xla_read``:
the statistics' bytes, one read) as yardsticks. The aligned layout's and the one-pass kernel's
loss and dlogits are compared with the rows layout's in the same run. ``step_bytes_per_s``
counts ``3 V b`` bytes per token for the two-kernel steps, ``2 V b`` for the one-pass step
(its HBM bytes when the second read hits L2) and ``V b`` for ``xla_read``;
``stats_bytes_per_s`` counts ``V b`` for a layout's statistics kernel.

With ``--tilings`` (vocabulary tile x warps per program), the tiling sweep instead: the aligned
layout's two kernels at ``pallas_gpu.plan_blocks``'s tiling (the row named ``aligned``) and at
each given one (``aligned_<tile>x<warps>``), each one's dlogits compared with the planner's.
With ``--one-pass-tilings`` (tile x warps x persistent programs [x load stages [x L2 hints]]),
the one-pass kernel alone at ``pallas_gpu_one_pass.plan_blocks``'s tiling (row ``one_pass``)
and at each given one (``one_pass_<tile>x<warps>x<programs>x<stages>``, with
``_no_l2_hints`` when the fifth number is 0; stages default to the planner's, hints to on),
timed as ``kernel_ms``, dlogits against the planner's.

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

from grpo_kernels import GRPOLossConfig, PallasBlockSizes, PallasOptions, grpo_loss
from grpo_kernels.objective import token_row_grad
from grpo_kernels.ops.logits_loss import pallas_gpu, pallas_gpu_one_pass
from grpo_kernels.ops.logits_loss.inputs import random_inputs
from grpo_kernels.proof.timing import median_ms

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
    if out is None or any(len(t) != 2 or not _tiling_ok(t) for t in out):
        raise argparse.ArgumentTypeError(
            f"--tilings wants vocabulary tile x warps pairs (a power of two x 1, 2, 4, 8, 16 "
            f"or 32) like 4096x4,8192x8, got {text!r}")
    return out


def one_pass_list(text: str) -> list[pallas_gpu_one_pass.OnePassBlocks]:
    """``"BVxWxP[xS[xH]],..."`` -> the one-pass tilings (block_vocab, num_warps, programs, load
    stages, L2 hints 0 or 1; stages default to the planner's, ``DEFAULT_STAGES``, hints to
    on); empty text: none."""
    out = _pairs(text)
    try:  # OnePassBlocks checks programs and stages itself
        if out is None or any(len(t) not in (3, 4, 5) or not _tiling_ok(t)
                              or t[4:] not in ((), (0,), (1,)) for t in out):
            raise ValueError(text)
        return [pallas_gpu_one_pass.OnePassBlocks(*t[:4], *(bool(h) for h in t[4:]))
                for t in out]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--one-pass-tilings wants tile x warps x programs [x load stages [x L2 hints]] "
            f"(a power of two x 1, 2, 4, 8, 16 or 32 x >= 1 [x 1 to "
            f"{pallas_gpu_one_pass.MAX_STAGES} [x 0 or 1]]) like "
            f"8192x8x264x1,16384x16x132,16384x16x132x2x0, got {text!r}") from None


def one_pass_name(b: pallas_gpu_one_pass.OnePassBlocks) -> str:
    """A swept one-pass tiling's row name: its numbers, and whether its L2 hints are off."""
    return (f"one_pass_{b.block_vocab}x{b.num_warps}x{b.programs}x{b.stages}"
            + ("" if b.l2_hints else "_no_l2_hints"))


def _tiling_ok(t: tuple[int, ...]) -> bool:
    return t[0] >= 1 and not t[0] & (t[0] - 1) and t[1] in (1, 2, 4, 8, 16, 32)


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


def _one_pass_kernel(z, ids, blocks, interpret: bool):
    """The one-pass kernel alone, jitted, on the default loss's columns for ``z``'s rows."""
    cfg = GRPOLossConfig()
    n = z.shape[0]
    k = jax.random.split(jax.random.PRNGKey(2), 2)
    cols = {"weights": jnp.full((n,), 1.0 / n), "mask": jnp.ones((n,)),
            "advantages": jax.random.normal(k[0], (n,)),
            "old_logp": -jnp.abs(jax.random.normal(k[1], (n,)))}
    return jax.jit(lambda z: pallas_gpu_one_pass.one_pass(
        z, ids, cols, lambda lp, c: token_row_grad(lp, c, cfg), 1.0, blocks,
        interpret=interpret)[2])


def measure_one_pass(n: int, vocab: int, tilings: list[pallas_gpu_one_pass.OnePassBlocks],
                     iters: int, rounds: int) -> list[dict]:
    """The one-pass sweep's JSON rows of one shape."""
    _, _, z, ids, _ = _inputs(n, vocab)
    interpret = _interpret()
    blocks = {"one_pass": pallas_gpu_one_pass.plan_blocks(n, vocab)}
    blocks.update({one_pass_name(b): b for b in tilings})
    fns = {name: {"kernel": _one_pass_kernel(z, ids, b, interpret)}
           for name, b in blocks.items()}
    times = _times(fns, {"kernel": (z,)}, iters, rounds)
    planned = fns["one_pass"]["kernel"](z)
    rows = []
    for name, b in blocks.items():
        row = _row(n, vocab, name, fns[name], times, block_vocab=b.block_vocab,
                   num_warps=b.num_warps, programs=b.programs, stages=b.stages,
                   l2_hints=b.l2_hints,
                   dlogits_max_rel_diff_to_planned=_rel(fns[name]["kernel"](z), planned))
        row["kernel_bytes_per_s"] = 2 * z.size * z.dtype.itemsize / (row["kernel_ms"] * 1e-3)
        rows.append(row)
    return rows


def measure(n: int, vocab: int, block_vocab: int | None, iters: int, rounds: int):
    """The layout A/B's JSON rows of one shape."""
    cfg, inp, z, ids, coef = _inputs(n, vocab)
    interpret = _interpret()

    def step(impl: str, **options):
        """The jitted value_and_grad of the loss on ``impl`` (pallas: the GPU kernel with
        ``options``)."""
        opts = (PallasOptions(kernel="gpu", blocks=PallasBlockSizes(block_vocab=block_vocab),
                              **options) if impl == "pallas" else None)
        return jax.jit(jax.value_and_grad(lambda z: grpo_loss(
            z, inp.ids, inp.mask, inp.advantages, config=cfg, impl=impl, options=opts,
            **inp.kwargs())[0]))

    fns, outs = {}, {}
    for layout in LAYOUTS:
        blocks = pallas_gpu.plan_blocks(vocab, block_vocab, layout)
        fns[layout] = {**_kernels(z, ids, coef, blocks, interpret),
                       "step": step("pallas", gpu_layout=layout)}
    fns["one_pass"] = {"step": step("pallas", one_pass=True)}
    for name in fns:
        outs[name] = fns[name]["step"](inp.logits)
    fns["xla"] = {"step": step("xla")}
    fns["xla_copy"] = {"step": jax.jit(lambda z: z + jnp.asarray(1, z.dtype))}
    fns["xla_read"] = {"step": jax.jit(lambda z: jnp.max(z, axis=-1))}
    times = _times(fns, {"stats": (z,), "grad": (z,), "step": (inp.logits,)}, iters, rounds)
    nbytes = z.size * z.dtype.itemsize
    loss_r, dz_r = outs["rows"]
    rows = []
    for name, kernels in fns.items():
        row = _row(n, vocab, name, kernels, times, block_vocab=block_vocab)
        if name != "xla_copy":
            moved = {"one_pass": 2, "xla_read": 1}.get(name, 3)
            row["step_bytes_per_s"] = moved * nbytes / (row["step_ms"] * 1e-3)
        if "stats" in kernels:  # one read of the logits
            row["stats_bytes_per_s"] = nbytes / (row["stats_ms"] * 1e-3)
        if name in outs and name != "rows":
            row["loss_rel_diff_to_rows"] = _rel(outs[name][0], loss_r)
            row["dlogits_max_rel_diff_to_rows"] = _rel(outs[name][1], dz_r)
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
    p.add_argument("--one-pass-tilings", type=one_pass_list, default=[],
                   help="the one-pass sweep instead of the layout A/B: the one-pass kernel at "
                   "these tilings (tile x warps x persistent programs [x load stages [x L2 "
                   "hints 0/1]], e.g. 16384x16x132x3,16384x16x132x2x0) and the planner's")
    p.add_argument("--iters", type=int, default=20, help="timed calls per median")
    p.add_argument("--rounds", type=int, default=2, help="rounds the layouts alternate over")
    args = p.parse_args(argv)
    if args.iters < 1 or args.rounds < 1:
        p.error(f"--iters and --rounds must be >= 1, got {args.iters} and {args.rounds}")
    if (args.tilings or args.one_pass_tilings) and args.block_vocab:
        p.error("--block-vocab is the layout A/B's; the sweeps take --tilings or "
                "--one-pass-tilings only")
    if args.tilings and args.one_pass_tilings:
        p.error("--tilings and --one-pass-tilings are two sweeps: give one")
    worst = 0.0
    for n, vocab in args.shapes:
        if args.tilings:
            rows = measure_tilings(n, vocab, args.tilings, args.iters, args.rounds)
        elif args.one_pass_tilings:
            rows = measure_one_pass(n, vocab, args.one_pass_tilings, args.iters, args.rounds)
        else:
            rows = measure(n, vocab, args.block_vocab, args.iters, args.rounds)
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
