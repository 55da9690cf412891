"""How much of the trainer's update a loss head can change: each arm beside the head-free floor.

    python3 benchmarks/update_floor.py                       # configs/learn.yaml's model, CPU
    python3 benchmarks/update_floor.py --tpu v6e --remat     # a v6e compile plan, no timing
    python3 benchmarks/update_floor.py --model qwen2.5-0.5b --layers 4 --rows 8

The program is ``rl.policy.make_programs``' gradient of one micro-batch, as ``grpo-kernels
train`` jits it, for the arms ``logits-reference`` (materialised logits) and ``fused-xla``
(the fused head), and for ``floor``: the same decoder's forward and backward with the head
replaced by a loss of the final hidden states alone (their mean square), which forms no
``[N, V]`` product. No head implementation can plan fewer temporaries or run faster than the
floor, so ``floor / logits-reference`` bounds every head's ratio from below; on the CPU the
script also times the head's three ``[N, H] x [H, V]`` matmuls (forward, dH, dW) alone, the
work any exact head does.

On the CPU each arm runs on the decoder's initial weights and a trainer micro-batch of
random tokens (``grpo_kernels.proof.gpu_train_step.micro_batch``), its steps timed back to
back, interleaved with the other arms', the median of ``--iters``; with ``--tpu GEN`` the
programs are compiled for that TPU generation with libtpu and nothing runs.
One JSON line per arm, then a table of ratios to ``logits-reference``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import tpu_compile

from grpo_kernels.proof import shapes

ARMS = ("logits-reference", "fused-xla", "floor")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--model", choices=sorted(shapes.RUN_MODELS), default="smollm2-135m",
                   help="the model's shape (default: smollm2-135m, configs/learn.yaml's)")
    p.add_argument("--layers", type=int, help="decoder layers kept, the first N (default: all)")
    p.add_argument("--rows", type=int, default=16, help="rows of the micro-batch (default: 16)")
    p.add_argument("--prompt", type=int, default=64, help="prompt width P (default: 64)")
    p.add_argument("--completion", type=int, default=64,
                   help="completion tokens C (default: 64)")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="model.param_dtype (default: float32, configs/learn.yaml's)")
    p.add_argument("--remat", action="store_true", help="model.remat")
    p.add_argument("--iters", type=int, default=3, help="timed steps per arm (default: 3)")
    p.add_argument("--tpu", choices=tpu_compile.GENERATIONS, metavar="GEN",
                   help="compile for this TPU generation with libtpu instead; nothing runs")
    p.add_argument("--libtpu", help="libtpu.so for --tpu (default: as tpu_compile.py)")
    p.add_argument("--out", help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    total = shapes.RUN_MODELS[args.model][2]
    args.layers = total if args.layers is None else args.layers
    try:
        shapes.check_at_least_one(args, ("rows", "prompt", "completion", "iters"))
        shapes.check_layers(args.model, args.layers, total)
    except ValueError as e:
        p.error(str(e))
    return args


def floor_loss(model, mb, *, prompt_width, **_):
    """The head-free loss: the mean square of the hidden states the head would read, and the
    metrics the trainer keeps, as zeros."""
    import jax.numpy as jnp

    from grpo_kernels.rl import policy
    hidden, _ = policy._fused_inputs(model, mb, prompt_width)
    zero = jnp.zeros((), jnp.float32)
    return jnp.mean(jnp.square(hidden.astype(jnp.float32))), {
        name: zero for name in policy.METRIC_NAMES}


def program(arm: str, graphdef, prompt: int):
    """The jitted ``grad_fn`` of ``arm``, as the trainer builds it (``floor``: with
    :func:`floor_loss` in place of the loss)."""
    from unittest import mock

    import jax

    from grpo_kernels.config import GRPOLossConfig
    from grpo_kernels.rl import policy
    from grpo_kernels.rl.kernel import resolve
    head, impl = ("fused", "xla") if arm == "floor" else arm.split("-", 1)
    _, options = resolve(head, impl, {})
    grad_fn, _ = policy.make_programs(graphdef, head=head, impl=impl,
                                      config=GRPOLossConfig(beta=0.0), prompt_width=prompt,
                                      options=options)
    if arm != "floor":
        return jax.jit(grad_fn)

    def traced(*a):  # the replacement holds while jit traces, and only then
        with mock.patch.object(policy, "loss_on", floor_loss):
            return grad_fn(*a)
    return jax.jit(traced)


def inputs(cfg, args, device, concrete: bool):
    """The graphdef and ``(state, micro-batch, scale, num_items)``: the decoder's initial
    weights and a trainer micro-batch (``gpu_train_step.micro_batch``, seed 0) when
    ``concrete``, else their shapes placed on ``device``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import SingleDeviceSharding

    from grpo_kernels.models.decoder import Decoder, empty_decoder
    from grpo_kernels.proof.gpu_train_step import micro_batch
    model = (Decoder(cfg, nnx.Rngs(0), remat=args.remat) if concrete
             else empty_decoder(cfg, args.remat))
    graphdef, state = nnx.split(model)
    mb = micro_batch(0, args.rows, args.prompt, args.completion, cfg.vocab_size)
    scalars = (np.float32(1.0), np.float32(mb["mask"].sum()))
    if concrete:
        place = jnp.asarray
    else:
        sh = SingleDeviceSharding(device)

        def place(x):
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sh)
    mb = {k: None if v is None else place(v) for k, v in mb.items()}
    return graphdef, (jax.tree.map(place, state), mb, *map(place, scalars))


def head_matmuls_s(cfg, n: int, iters: int) -> float:
    """Median seconds of the head's three matmuls in the compute dtype: logits ``h W``,
    ``dH = dZ W^T`` and ``dW = h^T dZ``, with float32 accumulation, as one program."""
    import jax
    import jax.numpy as jnp

    from grpo_kernels.proof.timing import median_ms
    f32, dt = jnp.float32, cfg.compute_dtype
    k = jax.random.split(jax.random.key(2), 3)
    h = jax.random.normal(k[0], (n, cfg.hidden_size), dt)
    w = jax.random.normal(k[1], (cfg.hidden_size, cfg.vocab_size), dt)
    dz = jax.random.normal(k[2], (n, cfg.vocab_size), dt)

    @jax.jit
    def three(h, w, dz):
        z = jnp.dot(h, w, preferred_element_type=f32)
        return (z.sum(), jnp.dot(dz, w.T, preferred_element_type=f32),
                jnp.dot(h.T, dz, preferred_element_type=f32))
    return median_ms(lambda: three(h, w, dz), iters) / 1e3


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.tpu and not tpu_compile.use_libtpu(args.libtpu, "update_floor"):
        return 2
    import jax
    import jax.numpy as jnp
    cfg = shapes.model_config(args.model, args.layers, shapes.RUN_MODELS)
    cfg = dataclasses.replace(cfg, param_dtype=jnp.dtype(args.param_dtype).type)
    device = tpu_compile.topology(args.tpu)[1][0] if args.tpu else jax.devices()[0]
    graphdef, a = inputs(cfg, args, device, concrete=not args.tpu)
    base = {"model": args.model, "layers": args.layers, "rows": args.rows,
            "prompt": args.prompt, "completion": args.completion,
            "param_dtype": args.param_dtype, "remat": args.remat,
            "platform": f"tpu {args.tpu}" if args.tpu else jax.devices()[0].platform,
            "jax": jax.__version__}
    rows, compiled = {}, {}
    for arm in ARMS:
        t0 = time.perf_counter()
        c = program(arm, graphdef, args.prompt).lower(*a).compile()
        rows[arm] = {**base, "arm": arm, "compile_s": round(time.perf_counter() - t0, 2),
                     "temp_bytes": int(c.memory_analysis().temp_size_in_bytes)}
        compiled[arm] = c
        print(f"update_floor: {arm} compiled", file=sys.stderr, flush=True)
    if not args.tpu:
        times = {arm: [] for arm in ARMS}
        for c in compiled.values():
            jax.block_until_ready(c(*a))  # warm
        for _ in range(args.iters):
            for arm, c in compiled.items():
                t0 = time.perf_counter()
                jax.block_until_ready(c(*a))
                times[arm].append(time.perf_counter() - t0)
        matmuls = head_matmuls_s(cfg, args.rows * args.completion, args.iters)
        for arm in ARMS:
            rows[arm]["step_s"] = statistics.median(times[arm])
            rows[arm]["head_matmuls_s"] = matmuls
    ref = rows["logits-reference"]
    for row in rows.values():
        row["temp_ratio"] = row["temp_bytes"] / ref["temp_bytes"]
        if "step_s" in row:
            row["time_ratio"] = row["step_s"] / ref["step_s"]
    lines = [json.dumps(r) for r in rows.values()]
    if args.out:
        with open(args.out, "a") as f:
            f.write("".join(line + "\n" for line in lines))
    print("\n".join(lines))
    print("\n| arm | planned temp MiB | / logits-reference | step s | / logits-reference |")
    print("|---|---|---|---|---|")
    for arm, r in rows.items():
        step = f"{r['step_s']:.2f} | {r['time_ratio']:.3f}" if "step_s" in r else "- | -"
        print(f"| {arm} | {r['temp_bytes'] / 2**20:,.0f} | {r['temp_ratio']:.3f} | {step} |")
    if not args.tpu:
        m = rows["floor"]["head_matmuls_s"]
        print(f"\nthe head's three matmuls alone: {m:.2f} s; floor + matmuls: "
              f"{(rows['floor']['step_s'] + m) / ref['step_s']:.3f} of logits-reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
