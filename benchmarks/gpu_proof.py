"""The accelerator proof run on a lent GPU: every phase in its own process, failures recorded.

Run from the repository root on the GPU host (the project need not be installed; ``src`` and
``benchmarks`` go on ``PYTHONPATH``):

    python3 benchmarks/gpu_proof.py --out $OUT --groups logits,lm_head,liger

Each phase is one subprocess with a time limit; its output goes to ``OUT/proof.log`` and every
JSON line it prints into ``OUT/proof.json``, with its exit code and wall time. A failing phase
never stops the next. The last lines printed are a short summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

LOGITS_SHAPES = [(1, 2048), (4, 1024)]
LOGITS_VOCAB = 151643
HEAD = dict(batch=1, time=8192, hidden=4096, vocab=151936)
ALIGNED_VOCAB = 151936
GRADCHECK_IMPLS = ("pallas", "xla")
MEMORY_IMPLS = ("reference", "xla", "pallas")
if os.environ.get("GPU_PROOF_SHORT"):  # a rerun that skips what an earlier run of it measured
    GRADCHECK_IMPLS, MEMORY_IMPLS = ("pallas",), ("pallas", "xla")
HEAD_CHUNKS: tuple[int, ...] = ()


def _cli(*args: object) -> list[str]:
    return [sys.executable, "-m", "grpo_kernels.cli.main", *map(str, args)]


def _script(name: str, *args: object) -> list[str]:
    return [sys.executable, f"benchmarks/{name}", *map(str, args)]


def phases(groups: set[str]) -> list[tuple[str, list[str], int]]:
    out: list[tuple[str, list[str], int]] = []
    if "env" in groups:
        out.append(("nvidia-smi", ["nvidia-smi"], 30))
        out.append(("versions", [sys.executable, "-c",
                                 "import jax, jaxlib, sys; print(sys.version); "
                                 "print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); "
                                 "print(jax.devices())"], 60))
        out.append(("copy_bandwidth", _script("copy_bandwidth.py", "--rows", 4096, "--vocab",
                                              LOGITS_VOCAB), 90))
    shape_flags = lambda b, t: ["--batch", b, "--time", t, "--vocab", LOGITS_VOCAB,  # noqa: E731
                                "--dtype", "bfloat16"]
    if "logits" in groups:
        for b, t in LOGITS_SHAPES:
            for impl in GRADCHECK_IMPLS:
                out.append((f"gradcheck_{impl}_B{b}_T{t}",
                            _cli("gradcheck", "--impl", impl, "--json", *shape_flags(b, t)), 120))
        for b, t in LOGITS_SHAPES:
            out.append((f"bench_B{b}_T{t}", _cli("bench", "--impl", "reference,xla,pallas",
                                                 "--iters", 20, "--warmup", 3,
                                                 *shape_flags(b, t)), 180))
        if ALIGNED_VOCAB:  # the same step with rows 16-byte aligned (Qwen's padded vocab)
            b, t = LOGITS_SHAPES[0]
            out.append((f"bench_B{b}_T{t}_V{ALIGNED_VOCAB}",
                        _cli("bench", "--impl", "reference,xla,pallas", "--iters", 20,
                             "--warmup", 3, "--batch", b, "--time", t, "--vocab", ALIGNED_VOCAB,
                             "--dtype", "bfloat16"), 180))
        for b, t in LOGITS_SHAPES:
            for impl in MEMORY_IMPLS:
                out.append((f"memory_{impl}_B{b}_T{t}",
                            _script("device_memory.py", "--op", "logits", "--impl", impl,
                                    *shape_flags(b, t)), 120))
            out.append((f"memory_pallas_donated_B{b}_T{t}",
                        _script("device_memory.py", "--op", "logits", "--impl", "pallas",
                                "--donate", *shape_flags(b, t)), 120))
    head_flags = ["--batch", HEAD["batch"], "--time", HEAD["time"], "--hidden", HEAD["hidden"],
                  "--vocab", HEAD["vocab"], "--dtype", "bfloat16"]
    if "lm_head" in groups:
        out.append(("head_gradcheck", _script("head_gradcheck.py", "--batch", HEAD["batch"],
                                              "--time", HEAD["time"], "--hidden",
                                              HEAD["hidden"], "--vocab", HEAD["vocab"]), 180))
        out.append(("bench_lm_head", _cli("bench-lm-head", "--impl", "reference,xla",
                                          "--iters", 10, "--warmup", 2, *head_flags), 240))
        for chunk in HEAD_CHUNKS:
            out.append((f"bench_lm_head_chunk{chunk}",
                        _cli("bench-lm-head", "--impl", "reference,xla", "--iters", 10,
                             "--warmup", 2, "--chunk-tokens", chunk, *head_flags), 240))
        for impl in ("reference", "xla"):
            out.append((f"memory_lm_head_{impl}",
                        _script("device_memory.py", "--op", "lm_head", "--impl", impl,
                                *head_flags), 180))
    if "liger" in groups:
        for b, t in LOGITS_SHAPES:
            out.append((f"liger_logits_B{b}_T{t}",
                        _script("liger_gpu_peer.py", "--op", "logits", *shape_flags(b, t)), 180))
        out.append(("liger_lm_head", _script("liger_gpu_peer.py", "--op", "lm_head",
                                             *head_flags), 240))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--groups", default="env,logits,lm_head,liger")
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
        for name, cmd, limit in phases(set(args.groups.split(","))):
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
