"""``grpo-kernels proof``: the accelerator proof in one command, each phase in its own process.

On a GPU host (the project installed with ``pip install --no-deps -e .`` in a source checkout,
plus the wheels of ``make proof-wheels``; ``make gpu-proof`` does both)::

    grpo-kernels proof --out DIR              # the issues' shapes, under 8 minutes on an H100
    grpo-kernels proof --out DIR --plan layouts   # the GPU kernel designs' A/B and sweeps
    grpo-kernels proof --out DIR --plan step  # training steps (415 s on an H100)
    grpo-kernels proof --out DIR --plan tunix # tunix's development head, chunked, beside ours
    grpo-kernels proof --out DIR --dry-run    # every phase at tiny shapes, on any backend
    grpo-kernels proof --out DIR --dry-run --plan step

Each phase is a subprocess with a time limit: copy bandwidth, gradcheck and bench of the
logits op (reference, xla, pallas), the family's gradcheck through pallas, device peak memory,
the fused LM head (gradcheck, bench with its matmul floor, memory) and the Liger-Kernel peers.
The ``layouts`` group (its own plan, since with it the whole proof would not fit in 8 minutes)
times the GPU kernel designs against each other: the two layouts and the one-pass kernel, the
one-pass kernel's tiling sweep and the aligned layout's.
The ``step`` plan times training steps instead of ops, each arm in its own process so that
the device's peak is the arm's: the trainer's update of a Qwen2.5-1.5B-shaped model for every
loss arm (:mod:`grpo_kernels.proof.gpu_train_step`), tunix's update with tunix's loss and
ours (:mod:`~grpo_kernels.proof.gpu_tunix_step`), the fused head in both ``dweight`` modes
beside Liger's fused loss eager and compiled (its device peak measured with the program
loaded from a compile cache, so that XLA:GPU's compile-time autotuning is not counted), and a
short trainer A/B (``grpo-kernels ab --processes per-arm``, ``grpo_kernels/proof/gpu_ab.yaml``).
The ``tunix`` plan runs the step plan's tunix programs against tunix's development head
(``--tunix-head``): its update and log-prob pass unchunked and with its own chunking
(``compute_logps_chunk_size`` 256), beside ours with the adapter's defaults.
A failing phase is recorded and the next one still runs. ``DIR/proof.log`` gets every phase's
output; ``DIR/proof.json`` (rewritten after each phase, so a crash keeps what finished) the
records, the machine, the derived figures and each target met or missed;
``DIR/proof.md`` the tables for docs/benchmarks.md. Each phase is a module of
:mod:`grpo_kernels.proof` run as ``python -m``, so the command runs from an installed wheel
as well as from a checkout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from grpo_kernels.cli import proof_report
from grpo_kernels.cli.proof_run import in_process_main, run_phase, run_phase_in_process
from grpo_kernels.cli.proof_plans import GROUPS, PLANS, REAL, STEP_GROUPS, Plan, plan_of


def _cli(*args: object) -> list[str]:
    return [sys.executable, "-m", "grpo_kernels.cli.main", *map(str, args)]


def _script(name: str, *args: object) -> list[str]:
    """The command that runs the phase module ``grpo_kernels.proof.<name>`` (``name``: its
    file name)."""
    return [sys.executable, "-m", f"grpo_kernels.proof.{name.removesuffix('.py')}",
            *map(str, args)]


_VERSIONS = (
    "import json, sys, platform, importlib.metadata as md, jax\n"
    "def v(n):\n"
    "    try: return md.version(n)\n"
    "    except md.PackageNotFoundError: return None\n"
    "d = jax.devices()[0]\n"
    "print(json.dumps({'python': sys.version.split()[0], 'platform': platform.platform(),\n"
    "    'backend': jax.default_backend(), 'device_kind': d.device_kind,\n"
    "    'device_count': jax.device_count(), **{n: v(n) for n in ('jax', 'jaxlib',\n"
    "    'jax-cuda13-plugin', 'torch', 'triton', 'liger-kernel', 'flax', 'optax',\n"
    "    'google-tunix', 'grpo-kernels')}}))\n"
)


def phases(groups: set[str], plan: Plan = REAL) -> list[tuple[str, list[str], int]]:
    """``(name, argv, time limit in s)`` of every phase of ``groups``, in order."""
    out: list[tuple[str, list[str], int]] = []
    if "env" in groups:
        out.append(("nvidia-smi", ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                   "--format=csv,noheader"], 30))
        out.append(("versions", [sys.executable, "-c", _VERSIONS], 60))
        out.append(("copy_bandwidth", _script("copy_bandwidth.py", "--rows", plan.copy_rows,
                                              "--vocab", plan.vocab), 90))

    def shape(b: int, t: int, v: int = plan.vocab) -> list[object]:
        return ["--batch", b, "--time", t, "--vocab", v, "--dtype", "bfloat16"]

    def layouts(*extra: object) -> list[str]:
        """proof/gpu_layouts.py at the plan's layout shapes."""
        return _script("gpu_layouts.py", "--shapes",
                       ",".join(f"{n}x{v}" for n, v in plan.layout_shapes),
                       "--iters", plan.iters, *extra)

    if "layouts" in groups:
        out.append(("gpu_layouts", layouts(*(["--block-vocab", plan.layout_block_vocab]
                                             if plan.layout_block_vocab else [])), 240))
        if plan.one_pass_tilings:
            out.append(("gpu_one_pass", layouts("--one-pass-tilings", ",".join(
                "x".join(map(str, t)) for t in plan.one_pass_tilings)), 240))
        if plan.layout_tilings:
            out.append(("gpu_tilings", layouts(
                "--tilings", ",".join(f"{bv}x{w}" for bv, w in plan.layout_tilings)), 180))
    if "logits" in groups:
        for b, t in plan.logits_shapes:
            for impl in plan.gradcheck_impls:
                out.append((f"gradcheck_{impl}_B{b}_T{t}",
                            _cli("gradcheck", "--impl", impl, "--json", *shape(b, t)), 120))
        fb, ft, fv = plan.family
        out.append(("gradcheck_family_pallas", _cli(
            "gradcheck", "--impl", "pallas", "--family", "--family-levels", plan.family_levels,
            "--json", *shape(fb, ft, fv)), 150))
        bench = ["bench", "--impl", "reference,xla,pallas", "--iters", plan.iters, "--warmup", 3,
                 "--format", "json"]
        for b, t in plan.logits_shapes:
            out.append((f"bench_B{b}_T{t}", _cli(*bench, *shape(b, t)), 180))
        for b, t in plan.logits_shapes:
            for impl in plan.memory_impls:
                out.append((f"memory_{impl}_B{b}_T{t}",
                            _script("device_memory.py", "--op", "logits", "--impl", impl,
                                    *shape(b, t)), 120))
            out.append((f"memory_pallas_donated_B{b}_T{t}",
                        _script("device_memory.py", "--op", "logits", "--impl", "pallas",
                                "--donate", *shape(b, t)), 120))
    hb, ht, hh, hv = plan.head
    head = ["--batch", hb, "--time", ht, "--hidden", hh, "--vocab", hv]
    if "lm_head" in groups:
        out.append(("head_gradcheck", _script("head_gradcheck.py", *head), 180))
        out.append(("bench_lm_head", _cli("bench-lm-head", "--impl", "reference,xla",
                                          "--iters", plan.head_iters, "--warmup", 2, *head,
                                          "--dtype", "bfloat16", "--format", "json"), 240))
        for impl in ("reference", "xla"):
            out.append((f"memory_lm_head_{impl}",
                        _script("device_memory.py", "--op", "lm_head", "--impl", impl, *head,
                                "--dtype", "bfloat16"), 180))
    out += step_phases(groups, plan, head)
    if "liger" in groups:
        for b, t in plan.logits_shapes:
            out.append((f"liger_logits_B{b}_T{t}",
                        _script("liger_peer.py", "--op", "logits", *shape(b, t)), 180))
        out.append(("liger_lm_head", _script("liger_peer.py", "--op", "lm_head", *head,
                                             "--dtype", "bfloat16"), 240))
    return out


def step_phases(groups: set[str], plan: Plan, head: list[object]
                ) -> list[tuple[str, list[str], int]]:
    """The phases of the step plan's groups (:data:`STEP_GROUPS`) in ``groups``."""
    out: list[tuple[str, list[str], int]] = []
    rows, prompt, completion = plan.step_batch
    shape = ["--model", plan.step_model, "--layers", plan.step_layers, "--rows", rows,
             "--prompt", prompt, "--completion", completion, "--iters", plan.step_iters]
    if "train" in groups:
        out += [(f"train_{arm}", _script("gpu_train_step.py", "--arm", arm, *shape), 150)
                for arm in plan.train_arms]
    if "head" in groups:
        for i, (dweight, rows_) in enumerate(plan.head_memory):
            name = f"head_{dweight}" + (f"_{rows_}" if rows_ else "")
            argv = ["--op", "lm_head", "--impl", "xla", *head, "--dtype", "bfloat16",
                    "--layout", "vh", "--dweight", dweight,
                    *(["--chunk-tokens", rows_] if rows_ else []),
                    "--compile-cache", f"{SCRATCH}/cache_{name}"]
            # the buffer assignment of the first two (the files back from a lent GPU are few)
            report = ["--buffer-report", f"{OUT_DIR}/{name}_buffers.txt"] if i < 2 else []
            out.append((f"compile_{name}", _script("device_memory.py", *argv, *report), 120))
            out.append((f"memory_{name}", _script("device_memory.py", *argv), 120))
        out.append(("liger_head_modes", _script(
            "liger_peer.py", "--op", "lm_head", *head, "--dtype", "bfloat16",
            "--head-variants", plan.head_variants, "--liger-modes", "eager,compiled",
            "--iters", plan.head_iters, "--warmup", 2), 300))
    if "tunix" in groups:
        out += [(f"tunix_{arm}", _script("gpu_tunix_step.py", "--arm", arm, *shape), 150)
                for arm in plan.tunix_arms]
        out += [(f"tunixhead_{head_arm(arm, chunk)}",
                 _script("gpu_tunix_step.py", "--arm", arm, *shape, "--tunix-path", TUNIX_HEAD,
                         *(["--chunk-size", chunk] if chunk else [])), 150)
                for arm, chunk in plan.tunix_head_arms]
    if "ab" in groups:
        out.append(("ab", _cli("ab", "--config", ab_config(),
                               "--arms", "logits-reference,fused-xla", "--processes", "per-arm",
                               "--steps", plan.ab_steps, "--json", "--no-progress",
                               "--run-dir", f"{SCRATCH}/ab", "--set",
                               f"model.tokenizer={TOKENIZER}",
                               *(x for item in plan.ab_sets for x in ("--set", item))), 360))
    return out


def head_arm(arm: str, chunk: int) -> str:
    """A tunix-head phase's arm label: ``arm``, with ``-chunkN`` where tunix chunks."""
    return f"{arm}-chunk{chunk}" if chunk else arm


# Placeholders in a phase's argv that run() fills: a scratch folder removed after the run
# (the A/B's run dirs, whose report and curves are copied into --out; compile caches), the
# tokenizer (--tokenizer), --out and tunix's development head (--tunix-head).
SCRATCH, TOKENIZER, OUT_DIR, TUNIX_HEAD = "@SCRATCH@", "@TOKENIZER@", "@OUT@", "@TUNIX_HEAD@"


def ab_config() -> Path:
    """The step plan's A/B config, shipped in the package (``grpo_kernels/proof/gpu_ab.yaml``)."""
    return Path(__file__).resolve().parents[1] / "proof" / "gpu_ab.yaml"


def default_tokenizer(plan: Plan) -> str:
    """The A/B's tokenizer when --tokenizer is not given: the dry run's the embedded
    SmolLM2 GGUF's (a tiny random model learns nothing either way); the step plan's Qwen2.5's,
    from ``.whl/qwen2.5-tokenizer`` under the working directory (``make proof-wheels`` copies
    it there)."""
    if plan.name.startswith("dry"):
        from grpo_kernels.models.gguf_loader import smollm2_path
        try:
            return smollm2_path()
        except (ImportError, ValueError, OSError):
            return ""
    return str(Path.cwd() / ".whl" / "qwen2.5-tokenizer")


def _fill(cmd: list[str], values: dict[str, str]) -> list[str]:
    """``cmd`` with each placeholder of ``values`` replaced wherever it occurs."""
    for key, value in values.items():
        cmd = [a.replace(key, value) for a in cmd]
    return cmd


def run(args: argparse.Namespace) -> int:
    plan = plan_of(args.plan, args.dry_run)
    groups = set(plan.groups if args.groups is None else args.groups.split(","))
    known = (*GROUPS, *STEP_GROUPS[1:])
    if not groups <= set(known):
        raise ValueError(f"--groups must be a comma-separated subset of {','.join(known)}, "
                         f"got {args.groups!r}")
    if args.budget_s <= 0:
        raise ValueError(f"--budget-s must be > 0, got {args.budget_s}")
    todo = phases(groups, plan)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    tokenizer = args.tokenizer or default_tokenizer(plan)
    tunix_head = os.path.abspath(args.tunix_head)
    start = time.perf_counter()
    records: list[dict] = []
    with open(out / "proof.log", "w", encoding="utf-8") as log, \
            tempfile.TemporaryDirectory(prefix="proof_") as scratch:
        for i, (name, cmd, limit) in enumerate(todo, 1):
            elapsed = time.perf_counter() - start
            uses_head = TUNIX_HEAD in cmd
            cmd = _fill(cmd, {SCRATCH: scratch, TOKENIZER: tokenizer, OUT_DIR: str(out),
                              TUNIX_HEAD: tunix_head})
            if elapsed > args.budget_s:
                records.append({"phase": name, "rc": "skipped", "wall_s": 0.0, "argv": cmd,
                                "rows": [], "reason": f"out of time ({elapsed:.0f} s)"})
                continue
            if name == "ab" and not os.path.exists(tokenizer):
                records.append({"phase": name, "rc": "skipped", "wall_s": 0.0, "argv": cmd,
                                "rows": [], "reason": f"no tokenizer at {tokenizer!r} (give "
                                "--tokenizer, or run `make proof-wheels` in a checkout beside "
                                "../shared/data/qwen2.5-tokenizer)"})
                continue
            if uses_head and not os.path.isdir(os.path.join(tunix_head, "tunix")):
                records.append({"phase": name, "rc": "skipped", "wall_s": 0.0, "argv": cmd,
                                "rows": [], "reason": f"no tunix under {tunix_head!r} (give "
                                "--tunix-head, or carry .whl from `make proof-wheels` and run "
                                "`make gpu-proof`, which installs the head there)"})
                continue
            main = in_process_main(cmd) if getattr(args, "in_process", False) else None
            rec = (run_phase_in_process(name, cmd, main) if main is not None else
                   run_phase(name, cmd, min(limit, max(10, args.budget_s + 30 - elapsed)), env))
            if name == "ab":
                keep_ab_report(rec, out)
            stdout, stderr = rec.pop("stdout"), rec.pop("stderr")
            rec["stderr_tail"] = stderr[-3000:]
            rec["stdout_tail"] = stdout[-3000:] if not rec["rows"] else ""
            log.write(f"===== {name} rc={rec['rc']} wall={rec['wall_s']:.1f}s\n"
                      f"$ {' '.join(cmd)}\n{stdout}\n--- stderr ---\n{stderr[-20000:]}\n")
            log.flush()
            records.append(rec)
            proof_report.write(out, plan.name, records, time.perf_counter() - start)
            print(f"[{time.perf_counter() - start:6.1f}s] ({i}/{len(todo)}) {name}: "
                  f"rc={rec['rc']} ({rec['wall_s']:.1f}s)", file=sys.stderr, flush=True)
            if rec["rc"] != 0 and stderr.strip():
                print("    " + stderr.strip().splitlines()[-1][:300], file=sys.stderr)
    report = proof_report.write(out, plan.name, records, time.perf_counter() - start)
    print((out / "proof.md").read_text(encoding="utf-8"))
    return 0 if report["all_phases_ok"] else 1


def keep_ab_report(rec: dict, out: Path) -> None:
    """Copies the A/B phase's report and curves (its JSON row names them) into ``out``, with
    the paths in the row rewritten to the copies."""
    for row in rec["rows"]:
        for key in ("report", "curves"):
            if row.get(key) and os.path.isfile(row[key]):
                dest = out / f"ab_{os.path.basename(row[key]).removeprefix('ab_')}"
                shutil.copyfile(row[key], dest)
                row[key] = dest.name


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "proof", help="the accelerator proof: every phase in its own process, proof.json/.md",
        description=(__doc__ or "").split("\n\n")[0] + ". Writes proof.log, proof.json and "
        "proof.md into --out; exit 0 only if every phase ran and succeeded (a skipped Liger "
        "peer, with its reason, counts as success).",
    )
    p.add_argument("--out", required=True, help="folder for proof.log, proof.json, proof.md")
    p.add_argument("--dry-run", action="store_true",
                   help="every phase at tiny shapes on whatever backend is there (pallas "
                   "interpreted off GPU/TPU); same files")
    p.add_argument("--plan", choices=sorted({*PLANS, "dry"}), default="real",
                   help="real: the issues' shapes; short: real without what an earlier run of "
                   "the same code measured (xla gradcheck, reference memory); layouts: the "
                   "GPU kernel designs' A/B and sweeps; step: training steps (the trainer's "
                   "update per loss arm, tunix's update, the fused head beside Liger, a "
                   "trainer A/B); tunix: tunix's development head's update and log-prob "
                   "pass, unchunked and chunked at 256, beside ours at the step plan's "
                   "shape; dry: = --dry-run. With --dry-run, step and tunix run their own "
                   "phases at tiny shapes, the others every op phase")
    p.add_argument("--groups", default=None,
                   help=f"comma-separated subset of {','.join(GROUPS)} or of the step plan's "
                   f"{','.join(STEP_GROUPS)} (default: the plan's; real and short: "
                   f"{','.join(REAL.groups)}; dry: all op groups)")
    p.add_argument("--tokenizer", default=None,
                   help="the step plan's A/B: a tokenizer directory or GGUF file (default: "
                   ".whl/qwen2.5-tokenizer under the working directory; the dry run: "
                   "SmolLM2's GGUF)")
    p.add_argument("--tunix-head", default=".whl/site-head", metavar="DIR",
                   help="the tunix plan: a directory holding tunix's development head "
                   "(default: .whl/site-head, where `make gpu-proof` installs it; a phase "
                   "finding none there is skipped with that reason)")
    p.add_argument("--in-process", action="store_true",
                   help="each of this package's phase modules called in this process (its "
                   "main(argv), output captured, no time limit) instead of a process of its "
                   "own: the dry run's plumbing without a Python start and imports per phase "
                   "(device peaks are then not the phase's own)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="phases that would start after this many seconds are skipped "
                   "(recorded as such)")
    p.set_defaults(run=run)
