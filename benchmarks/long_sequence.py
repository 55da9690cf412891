"""Long sequences through the fused LM-head loss.

    python benchmarks/long_sequence.py plan            # planned temporaries, compile-only
    python benchmarks/long_sequence.py run             # a real step at T = 131,072 (minutes)

``plan``: XLA's planned temporaries (``memory_analysis().temp_size_in_bytes``) of one
``value_and_grad`` of the fused op (impl xla, bf16, B=1, H=4096, V=151,936, beta 0.04) at
T = 8,192, 32,768 and 131,072, on one device and with the vocabulary split over 8 simulated
devices (per device), next to the reference's plan. Nothing is allocated.

``run``: ``value_and_grad`` of the fused op at B=1, T=131,072, H=512, V=32,768 (bf16 inputs,
on-policy, loss_type dapo with ``num_items_in_batch`` given, so each token's weight is its own),
timed once
after a compile, with the process's peak RSS; then the reference, which would need a
``[T, V]`` float32 logits array, in pieces of ``--piece`` tokens whose losses and ``dhidden``
concatenate and whose ``dW`` add up. Prints the relative errors of the loss and both gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "plan":
    # the 8-way vocabulary split needs 8 devices, created only before JAX starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")

import resource  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from grpo_kernels import GRPOLossConfig, grpo_loss_from_hidden  # noqa: E402

PLAN_TIMES = (8192, 32768, 131072)
CFG = GRPOLossConfig(beta=0.04)


def _specs(t: int, h: int, v: int):
    s = jax.ShapeDtypeStruct
    return (s((1, t, h), jnp.bfloat16), s((h, v), jnp.bfloat16), s((1, t), jnp.int32),
            s((1, t), jnp.float32), s((1,), jnp.float32), s((1, t), jnp.float32),
            s((1, t), jnp.float32))


def planned_temp(t: int, h: int, v: int, impl: str = "xla", vocab_shards: int = 1) -> int:
    """Planned temporaries (per device) of the fused op's ``value_and_grad``."""
    if vocab_shards == 1:
        def f(hid, w, ids, mask, adv, old, ref):
            return grpo_loss_from_hidden(hid, w, ids, mask, adv, config=CFG, impl=impl,
                                         old_logps=old, ref_logps=ref)
    else:
        from grpo_kernels.sharding import ShardingSpec, mesh_from_shape
        from grpo_kernels.sharding.loss import sharded_grpo_loss_from_hidden

        mesh = mesh_from_shape((vocab_shards,), ("tp",))

        def f(hid, w, ids, mask, adv, old, ref):
            return sharded_grpo_loss_from_hidden(
                hid, w, ids, mask, adv, mesh=mesh, sharding=ShardingSpec((), "tp"),
                config=CFG, impl=impl, old_logps=old, ref_logps=ref)
    step = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
    return step.lower(*_specs(t, h, v)).compile().memory_analysis().temp_size_in_bytes


def plan(h: int = 4096, v: int = 151936) -> list[dict]:
    rows = []
    for t in PLAN_TIMES:
        row = {"time": t, "hidden": h, "vocab": v,
               "fused_one_device": planned_temp(t, h, v),
               "fused_per_device_vocab8": planned_temp(t, h, v, vocab_shards=8),
               "reference_one_device": planned_temp(t, h, v, impl="reference")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]
    print(f"\n{'T':>8} {'fused GiB':>10} {'vs T=8192':>10} {'per device, V/8':>16} "
          f"{'/ one device':>13} {'reference GiB':>14}")
    for r in rows:
        one, split = r["fused_one_device"], r["fused_per_device_vocab8"]
        print(f"{r['time']:>8} {one / 2**30:>10.3f} {one / base['fused_one_device']:>10.4f} "
              f"{split / 2**30:>16.3f} {split / one:>13.4f} "
              f"{r['reference_one_device'] / 2**30:>14.2f}")
    return rows


def _inputs(t: int, h: int, v: int, seed: int = 0):
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    hid = (jax.random.normal(k[0], (1, t, h), jnp.float32)).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (h, v), jnp.float32) / np.sqrt(h)).astype(jnp.bfloat16)
    ids = jax.random.randint(k[2], (1, t), 0, v, dtype=jnp.int32)
    mask = (jax.random.uniform(k[3], (1, t)) < 0.9).astype(jnp.float32)
    adv = jax.random.normal(k[4], (1,), jnp.float32)
    return hid, w, ids, mask, adv


def run(t: int, h: int, v: int, piece: int) -> dict:
    cfg = GRPOLossConfig(loss_type="dapo", beta=0.0)
    hid, w, ids, mask, adv = _inputs(t, h, v)
    # on-policy: old = logp, ratio 1, so no token sits in a clipped region with a zero gradient
    # (a random old log-prob far from logp clips every token when A < 0)
    old = None
    n_items = jnp.sum(mask)  # dapo's normaliser, given: a token's weight is m / n_items

    def loss(impl, hid, w, ids, mask):
        return grpo_loss_from_hidden(hid, w, ids, mask, adv, config=cfg, impl=impl,
                                     old_logps=old, num_items_in_batch=n_items)[0]

    fused = jax.jit(jax.value_and_grad(lambda a, b: loss("xla", a, b, ids, mask), (0, 1)))
    t0 = time.perf_counter()
    compiled = fused.lower(hid, w).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    value, (dh, dw) = jax.block_until_ready(compiled(hid, w))
    step_s = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    ref = jax.jit(jax.value_and_grad(lambda a, b, i, m: loss("reference", a, b, i, m), (0, 1)))
    ref_value, ref_dh, ref_dw = 0.0, [], jnp.zeros((h, v), jnp.float32)
    for s in range(0, t, piece):
        sl = slice(s, s + piece)
        val, (a, b) = ref(hid[:, sl], w, ids[:, sl], mask[:, sl])
        ref_value += float(val)
        ref_dh.append(a)
        ref_dw = ref_dw + b.astype(jnp.float32)
    ref_dh = jnp.concatenate(ref_dh, axis=1)

    def rel(x, y):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))

    out = {"time": t, "hidden": h, "vocab": v, "piece": piece, "compile_s": compile_s,
           "step_s": step_s, "peak_rss_bytes_after_step": rss,
           "temp_size_in_bytes": compiled.memory_analysis().temp_size_in_bytes,
           "loss": float(value), "loss_reference_in_pieces": ref_value,
           "loss_rel_err": abs(float(value) - ref_value) / abs(ref_value),
           "dhidden_rel_err": rel(dh.astype(jnp.float32), ref_dh.astype(jnp.float32)),
           "dW_rel_err": rel(dw.astype(jnp.float32), ref_dw),
           "dhidden_norm": float(jnp.linalg.norm(dh.astype(jnp.float32))),
           "dW_norm": float(jnp.linalg.norm(dw.astype(jnp.float32))),
           "finite": bool(np.isfinite(float(value)) and jnp.isfinite(dh).all()
                          and jnp.isfinite(dw).all())}
    print(json.dumps(out), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["plan", "run"])
    p.add_argument("--time", type=int, default=131072, help="run: tokens")
    p.add_argument("--hidden", type=int, default=512, help="run: H")
    p.add_argument("--vocab", type=int, default=32768, help="run: V")
    p.add_argument("--piece", type=int, default=8192, help="run: tokens per reference piece")
    args = p.parse_args(argv)
    if args.what == "plan":
        plan()
    else:
        if min(args.time, args.hidden, args.vocab, args.piece) < 1:
            p.error("--time, --hidden, --vocab and --piece must be >= 1")
        run(args.time, args.hidden, args.vocab, args.piece)
    return 0


if __name__ == "__main__":
    sys.exit(main())
