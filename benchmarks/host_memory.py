"""Host memory of one value_and_grad step per implementation, each in a fresh process.

    python benchmarks/host_memory.py --batch 4 --time 1024 --vocab 32768 --dtype bfloat16

For each implementation a subprocess builds the inputs without materialising anything of
[B, T, V] size beyond the logits, compiles the step, resets the kernel's peak-RSS mark
(/proc/self/clear_refs, Linux) and runs two steps. It reports the RSS before the steps and how
far the peak rose above it: the step's real host footprint on a CPU backend, the dlogits output
included. Complements the compiled temp bytes that `grpo-kernels bench` reports.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = r"""
import json, sys
import numpy as np, ml_dtypes, jax, jax.numpy as jnp
from grpo_kernels import GRPOLossConfig, grpo_loss
from grpo_kernels.cli.bench import proc_status_bytes, reset_peak_rss
impl, B, T, V, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
rng = np.random.default_rng(0)
z = np.empty((B, T, V), np_dtype)
for b in range(B):
    for t0 in range(0, T, 64):
        z[b, t0:t0 + 64] = (2 * rng.standard_normal(z[b, t0:t0 + 64].shape, dtype=np.float32)).astype(np_dtype)
z = jnp.asarray(z)
ids = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
mask = jnp.ones((B, T), jnp.float32)
adv = jnp.asarray(rng.normal(size=B), jnp.float32)
old = jnp.asarray(rng.normal(size=(B, T)) - 10, jnp.float32)
cfg = GRPOLossConfig()
fn = lambda x: grpo_loss(x, ids, mask, adv, config=cfg, impl=impl, old_logps=old, ref_logps=old + 0.1)
step = jax.jit(jax.value_and_grad(fn, has_aux=True))
step.lower(z).compile()
import gc; gc.collect()
if not reset_peak_rss():
    sys.exit("needs Linux /proc/self/clear_refs to reset the peak-RSS mark")
before = proc_status_bytes("VmRSS")
for _ in range(2):
    out = step(z); jax.block_until_ready(out); del out
peak = proc_status_bytes("VmHWM")
print(json.dumps({"impl": impl, "rss_before_bytes": before, "peak_rss_bytes": peak,
                  "step_increase_bytes": peak - before,
                  "dlogits_bytes": int(np.prod(z.shape)) * z.dtype.itemsize}))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", default="reference,xla")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--time", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args(argv)
    for impl in args.impl.split(","):
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, impl, str(args.batch), str(args.time),
             str(args.vocab), args.dtype], capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return out.returncode
        rec = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps(rec))
        print(f"  {impl:10s} step raises peak RSS by {rec['step_increase_bytes'] / 2**20:8.1f} MiB "
              f"(dlogits output: {rec['dlogits_bytes'] / 2**20:.1f} MiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
