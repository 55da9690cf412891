"""The accelerator proof run on a lent GPU: every phase in its own process, failures recorded.

Run from the repository root on the GPU host (the project need not be installed; ``src`` and
``benchmarks`` go on ``PYTHONPATH``):

    python3 benchmarks/gpu_proof.py --out $OUT --groups env,logits,lm_head,liger

``--plan dry`` runs every phase at tiny shapes on whatever backend is there (the CPU in CI:
pallas interpreted, device memory and the Liger peers then exit with their reason).

Each phase is one subprocess with a time limit; its output goes to ``OUT/proof.log`` and every
JSON line it prints into ``OUT/proof.json``, with its exit code and wall time. A failing phase
never stops the next. The last lines printed are a short summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

@dataclasses.dataclass(frozen=True)
class Plan:
    """Shapes and lists of one proof run."""

    logits_shapes: tuple[tuple[int, int], ...] = ((1, 2048), (4, 1024))
    vocab: int = 151643
    aligned_vocab: int | None = 151936  # Qwen's padded vocabulary: 16-byte aligned rows
    head: tuple[int, int, int, int] = (1, 8192, 4096, 151936)  # B, T, H, V
    copy_rows: int = 4096
    gradcheck_impls: tuple[str, ...] = ("pallas", "xla")
    memory_impls: tuple[str, ...] = ("reference", "xla", "pallas")
    iters: int = 20
    head_iters: int = 10


REAL = Plan()
# A rerun that skips what an earlier run of the same code measured (xla gradcheck, reference memory).
SHORT = dataclasses.replace(REAL, gradcheck_impls=("pallas",), memory_impls=("pallas", "xla"))
# Every phase at tiny shapes, on whatever backend is there (CI runs it on the CPU).
DRY = Plan(logits_shapes=((1, 8), (2, 5)), vocab=300, aligned_vocab=256, head=(1, 16, 32, 300),
           copy_rows=16, iters=2, head_iters=2)


def _cli(*args: object) -> list[str]:
    return [sys.executable, "-m", "grpo_kernels.cli.main", *map(str, args)]


def _script(name: str, *args: object) -> list[str]:
    return [sys.executable, f"benchmarks/{name}", *map(str, args)]


def phases(groups: set[str], plan: Plan = REAL) -> list[tuple[str, list[str], int]]:
    """``(name, argv, time limit in s)`` of every phase of ``groups``, in order."""
    out: list[tuple[str, list[str], int]] = []
    if "env" in groups:
        out.append(("nvidia-smi", ["nvidia-smi"], 30))
        out.append(("versions", [sys.executable, "-c",
                                 "import jax, jaxlib, sys; print(sys.version); "
                                 "print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); "
                                 "print(jax.devices())"], 60))
        out.append(("copy_bandwidth", _script("copy_bandwidth.py", "--rows", plan.copy_rows,
                                              "--vocab", plan.vocab), 90))
    shape_flags = lambda b, t: ["--batch", b, "--time", t, "--vocab", plan.vocab,  # noqa: E731
                                "--dtype", "bfloat16"]
    if "logits" in groups:
        for b, t in plan.logits_shapes:
            for impl in plan.gradcheck_impls:
                out.append((f"gradcheck_{impl}_B{b}_T{t}",
                            _cli("gradcheck", "--impl", impl, "--json", *shape_flags(b, t)), 120))
        for b, t in plan.logits_shapes:
            out.append((f"bench_B{b}_T{t}", _cli("bench", "--impl", "reference,xla,pallas",
                                                 "--iters", plan.iters, "--warmup", 3,
                                                 *shape_flags(b, t)), 180))
        if plan.aligned_vocab:  # the same step with rows 16-byte aligned (Qwen's padded vocab)
            b, t = plan.logits_shapes[0]
            out.append((f"bench_B{b}_T{t}_V{plan.aligned_vocab}",
                        _cli("bench", "--impl", "reference,xla,pallas", "--iters", plan.iters,
                             "--warmup", 3, "--batch", b, "--time", t, "--vocab", plan.aligned_vocab,
                             "--dtype", "bfloat16"), 180))
        for b, t in plan.logits_shapes:
            for impl in plan.memory_impls:
                out.append((f"memory_{impl}_B{b}_T{t}",
                            _script("device_memory.py", "--op", "logits", "--impl", impl,
                                    *shape_flags(b, t)), 120))
            out.append((f"memory_pallas_donated_B{b}_T{t}",
                        _script("device_memory.py", "--op", "logits", "--impl", "pallas",
                                "--donate", *shape_flags(b, t)), 120))
    hb, ht, hh, hv = plan.head
    head_flags = ["--batch", hb, "--time", ht, "--hidden", hh, "--vocab", hv]
    if "lm_head" in groups:
        out.append(("head_gradcheck", _script("head_gradcheck.py", *head_flags), 180))
        out.append(("bench_lm_head", _cli("bench-lm-head", "--impl", "reference,xla",
                                          "--iters", plan.head_iters, "--warmup", 2, *head_flags,
                                          "--dtype", "bfloat16"), 240))
        for impl in ("reference", "xla"):
            out.append((f"memory_lm_head_{impl}",
                        _script("device_memory.py", "--op", "lm_head", "--impl", impl,
                                *head_flags, "--dtype", "bfloat16"), 180))
    if "liger" in groups:
        for b, t in plan.logits_shapes:
            out.append((f"liger_logits_B{b}_T{t}",
                        _script("liger_gpu_peer.py", "--op", "logits", *shape_flags(b, t)), 180))
        out.append(("liger_lm_head", _script("liger_gpu_peer.py", "--op", "lm_head",
                                             *head_flags, "--dtype", "bfloat16"), 240))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--groups", default="env,logits,lm_head,liger")
    p.add_argument("--plan", choices=["real", "short", "dry"], default="real",
                   help="real: the issues' shapes; short: real without what an earlier run of "
                   "the same code measured; dry: every phase at tiny shapes (a CPU test)")
    p.add_argument("--budget-s", type=float, default=560.0,
                   help="skip phases that would start after this many seconds")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, ["src", "benchmarks",
                                                      env.get("PYTHONPATH")]))
    start = time.perf_counter()
    records = []
    with open(os.path.join(args.out, "proof.log"), "w") as log:
        plan = {"real": REAL, "short": SHORT, "dry": DRY}[args.plan]
        for name, cmd, limit in phases(set(args.groups.split(",")), plan):
            elapsed = time.perf_counter() - start
            if elapsed > args.budget_s:
                records.append({"phase": name, "rc": None, "skipped": "out of time"})
                continue
            limit = min(limit, max(10, args.budget_s + 30 - elapsed))
            t0 = time.perf_counter()
            try:
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
                rc, stdout, stderr = r.returncode, r.stdout, r.stderr
            except OSError as e:
                rc, stdout, stderr = "not run", "", str(e)
            except subprocess.TimeoutExpired as e:
                rc = "timeout"
                stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            wall = time.perf_counter() - t0
            log.write(f"===== {name} rc={rc} wall={wall:.1f}s\n$ {' '.join(cmd)}\n")
            log.write(stdout + "\n--- stderr ---\n" + stderr[-20000:] + "\n")
            log.flush()
            rows = []
            for line in stdout.splitlines():
                if line.startswith("{"):
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass
            records.append({"phase": name, "rc": rc, "wall_s": wall, "rows": rows,
                            "stdout_tail": stdout[-3000:], "stderr_tail": stderr[-3000:]})
            with open(os.path.join(args.out, "proof.json"), "w") as f:
                json.dump(records, f, indent=1)
            print(f"[{time.perf_counter() - start:6.1f}s] {name}: rc={rc} ({wall:.1f}s)",
                  flush=True)
            if rc != 0:
                print("    " + (stderr.strip().splitlines() or ["(no stderr)"])[-1][:300])
    print("\n===== summary")
    for rec in records:
        for row in rec.get("rows", []):
            keep = {k: row[k] for k in ("impl", "median_step_ms", "first_call_s",
                                        "peak_bytes_in_use", "temp_size_in_bytes",
                                        "median_step_ms_ratio_to_reference",
                                        "time_over_3_matmuls", "passed", "max_rel_diff_dlogits",
                                        "abs_diff_loss", "bandwidth_bytes_per_s",
                                        "peak_over_logits_plus_dlogits", "ours_over_liger",
                                        "liger", "loss_rel_diff", "bound", "dhidden_err_xla",
                                        "dW_err_xla") if k in row}
            print(rec["phase"], json.dumps(keep))
        if not rec.get("rows"):
            print(rec["phase"], "rc", rec.get("rc"), rec.get("skipped", ""),
                  (rec.get("stdout_tail") or "")[-400:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
