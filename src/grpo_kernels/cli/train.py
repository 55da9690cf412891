"""``grpo-kernels train``, ``ab`` and ``eval``: GRPO runs from a YAML config."""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from typing import Any

import yaml

from grpo_kernels.cli import common
from grpo_kernels.ops import LOSS_HEADS, LOSS_IMPLS


def _parse_set(items: list[str]) -> dict[str, Any]:
    """``["train.steps=10", "loss.impl=xla"]`` -> dotted overrides (values parsed as YAML)."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE (e.g. train.steps=10)")
        out[key.strip()] = yaml.safe_load(value)
    return out


def load_config(args: argparse.Namespace, **extra: Any) -> Any:
    """The YAML file with ``--set`` and the command's own flags on top, validated."""
    from grpo_kernels.rl.config import TrainConfig, set_dotted

    values = common.load_yaml(args.config) if args.config else {}
    overrides = {**_parse_set(args.set), **{k: v for k, v in extra.items() if v is not None}}
    for key, value in overrides.items():
        set_dotted(values, key, value)
    try:
        return TrainConfig.from_dict(values)
    except ValueError as e:
        where = f"--config {args.config!r}: " if args.config else ""
        raise ValueError(f"{where}{e}") from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file (sections: model, data, rewards, rollout, optim, "
                   "train, loss, mesh, logging; see configs/)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override one config key, e.g. --set optim.learning_rate=1e-5 "
                   "(repeatable)")
    p.add_argument("--run-dir", help="override train.run_dir")
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_train(args: argparse.Namespace) -> int:
    from grpo_kernels.rl import processes
    from grpo_kernels.rl.trainer import Trainer

    config = load_config(args, **{"train.run_dir": args.run_dir, "train.steps": args.steps,
                                  "loss.head": args.head, "loss.impl": args.impl})
    joined = processes.join(args.coordinator, args.num_processes, args.process_id)

    def train():
        return Trainer(config, progress=not args.no_progress).run()

    records = processes.or_die(train) if joined else train()
    if not processes.is_primary():  # process 0 reports for all
        return 0
    last = records[-1] if records else None
    if last:
        print(f"step {last['step']}: reward {last['reward/mean']:.3f}, loss {last['loss']:.4g}, "
              f"step_avg_last10_s {last['time/train/step_avg_last10_s']:.3f}")
    print(f"metrics: {os.path.join(config.train.run_dir, 'metrics.jsonl')}")
    return 0


def parse_arms(text: str) -> list[tuple[str, str, str, dict[str, Any]]]:
    """``"logits-reference,fused-xla:loss.truncation=false"`` -> ``[(name, head, impl,
    overrides)]``: each arm a ``HEAD-IMPL`` pair, optionally followed by ``:KEY=VALUE`` config
    overrides of its own (values parsed as YAML)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    good = [f"{h}-{i}" for h in LOSS_HEADS for i in LOSS_IMPLS]
    pairs = [name.split(":")[0] for name in names]
    bad = [a for a in pairs if a not in good]
    if len(names) < 2 or bad or len(set(names)) < len(names):
        raise ValueError(f"--arms must name two or more different arms, each a HEAD-IMPL pair "
                         f"of {good} with optional :KEY=VALUE overrides, got {text!r}")
    arms = []
    for name, pair in zip(names, pairs):
        try:
            overrides = _parse_set(name.split(":")[1:])
        except ValueError as e:
            raise ValueError(f"--arms {name!r}: {e}") from None
        arms.append((name, *pair.split("-", 1), overrides))
    return arms


def run_ab(args: argparse.Namespace) -> int:
    import jax

    from grpo_kernels.rl.report import ab_report
    from grpo_kernels.rl.trainer import Trainer

    arms = parse_arms(args.arms)
    base = load_config(args, **{"train.steps": args.steps, "train.run_dir": args.run_dir,
                                "eval.num_problems": args.eval})
    configs = {name: base.replace(**{**extra, "loss.head": h, "loss.impl": i, "train.run_dir":
                                       os.path.join(base.train.run_dir, name)})
               for name, h, i, extra in arms}  # all validated before any run starts
    for (arm, config), extra in zip(configs.items(), (a[3] for a in arms)):
        print(f"== {arm}: {config.train.run_dir}", file=sys.stderr)
        if args.processes == "per-arm":
            run_arm_process(args, config, extra)
            continue
        trainer = Trainer(config, progress=not args.no_progress)
        trainer.run()
        del trainer
        gc.collect()
        jax.clear_caches()
    md, png, summary = ab_report({a: c.train.run_dir for a, c in configs.items()},
                           base.train.run_dir, title=args.title or
                           f"GRPO A/B: {', '.join(configs)} ({base.train.steps} steps)")
    with open(md, encoding="utf-8") as f:
        print(f.read())
    print(f"report: {md}\ncurves: {png}")
    if args.json:
        print(json.dumps({"op": "ab", "report": md, "curves": png, **summary}))
    return 0


def run_arm_process(args: argparse.Namespace, config: Any,
                    extra: dict[str, Any] | None = None) -> None:
    """One arm of ``ab --processes per-arm``: ``grpo-kernels train`` in a fresh process with
    ``args``' config and overrides, the arm's own (``extra``), head and impl, and its run dir.
    ValueError when it fails (the runs before it are kept)."""
    own = [f"{k}={json.dumps(v)}" for k, v in (extra or {}).items()]
    cmd = [sys.executable, "-m", "grpo_kernels.cli.main", "train",
           *(["--config", args.config] if args.config else []),
           *(x for item in [*(args.set or []), *own] for x in ("--set", item)),
           "--set", f"loss.head={config.loss.head}", "--set", f"loss.impl={config.loss.impl}",
           "--set", f"eval.num_problems={config.eval.num_problems}",
           "--run-dir", config.train.run_dir, "--steps", str(config.train.steps),
           *(["--no-progress"] if args.no_progress else [])]
    rc = subprocess.run(cmd, check=False).returncode
    if rc != 0:
        raise ValueError(f"arm {config.loss.head}-{config.loss.impl}: `grpo-kernels train` "
                         f"exited with {rc} (run dir {config.train.run_dir})")


def run_eval(args: argparse.Namespace) -> int:
    import json

    from grpo_kernels.rl import data as data_lib
    from grpo_kernels.rl.evaluate import evaluate, held_out
    from grpo_kernels.rl.trainer import Trainer, load_policy

    extra = {"data.source": "gsm8k", "data.path": args.data} if args.data else {}
    config = load_config(args, **{"train.run_dir": args.checkpoint, **extra})
    if config.data.source == "gsm8k":
        problems = data_lib.load_gsm8k(config.data.path)[:args.limit]
    else:  # the held-out problems a training run of this config scores (eval_problems.jsonl)
        pool = data_lib.load_problems(config.data.source, config.data.path,
                                      config.data.difficulty, config.data.num_problems,
                                      config.seed)
        problems = held_out(config, pool, args.limit)
    if args.checkpoint:
        if not os.path.isdir(os.path.join(args.checkpoint, "checkpoints")):
            raise ValueError(f"--checkpoint {args.checkpoint!r}: no checkpoints/ directory "
                             "(expected a train.run_dir)")
        trainer = Trainer(config, progress=False)
        step = trainer.restore()
        from flax import nnx

        nnx.update(trainer.model, trainer.state)
        model, tokenizer = trainer.model, trainer.tokenizer
    else:
        step = 0
        model, tokenizer = load_policy(config)
    result = evaluate(model, tokenizer, problems, system_prompt=config.data.system_prompt,
                      max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                      progress=not args.no_progress)
    result.update({"checkpoint": args.checkpoint, "checkpoint_step": step,
                   "data": config.data.path or f"arithmetic level {config.data.difficulty}"})
    print(json.dumps(result, indent=1))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("train", help="GRPO training run from a YAML config",
                       description="GRPO training: rollout, rewards, advantages, update with "
                       "the loss of loss.head and loss.impl; resumes from the run dir's last "
                       "checkpoint. Writes metrics.jsonl, samples.jsonl, W&B files and "
                       "checkpoints into train.run_dir.")
    _common(p)
    p.add_argument("--head", choices=LOSS_HEADS, help="override loss.head")
    p.add_argument("--impl", choices=LOSS_IMPLS, help="override loss.impl")
    g = p.add_argument_group(
        "several processes (one command per process or host; docs/sharding.md)",
        "All three, or none (then from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and "
        "JAX_PROCESS_ID when set). mesh.shape must cover every process's devices; each process "
        "samples its share of each step's problems; process 0 writes metrics and samples, all "
        "write checkpoints (a run dir every process can reach).")
    g.add_argument("--coordinator", help="HOST:PORT of process 0's coordination service")
    g.add_argument("--num-processes", type=int, help="number of processes")
    g.add_argument("--process-id", type=int, help="this process's index, 0 .. N-1")
    p.set_defaults(run=run_train)

    p = sub.add_parser("ab", help="the same GRPO run with several losses, and a report",
                       description="Runs the config once per --arms entry (same seed; run "
                       "dirs RUN_DIR/<arm>), then writes RUN_DIR/ab_report.md and "
                       "RUN_DIR/ab_curves.png. The first arm is the baseline.")
    _common(p)
    p.add_argument("--arms", default="logits-reference,fused-xla",
                   help="comma-separated arms, each a HEAD-IMPL pair: loss.head (logits | "
                   "fused) and loss.impl (auto | reference | xla | pallas), optionally with "
                   "config overrides of its own, e.g. fused-xla:loss.truncation=false "
                   "(default: logits-reference,fused-xla)")
    p.add_argument("--title", help="title of the report and plot")
    p.add_argument("--processes", choices=["one", "per-arm"], default="one",
                   help="one: every arm in this process (default); per-arm: each arm in a "
                   "fresh `grpo-kernels train` process, so that a GPU's or TPU's peak memory "
                   "(a process-wide high-water mark) is the arm's own")
    p.add_argument("--eval", type=int, metavar="N",
                   help="score each arm's greedy accuracy on N held-out problems before step 1 "
                   "and after the last step, into the report (overrides eval.num_problems)")
    p.add_argument("--json", action="store_true",
                   help="also print the report's numbers as one JSON line")
    p.set_defaults(run=run_ab)

    p = sub.add_parser("eval", help="greedy accuracy on a problem set",
                       description="Greedy completions of the first --limit problems (GSM8K "
                       "from --data or data.path; for generated arithmetic, the held-out "
                       "problems a training run of the config scores); accuracy by "
                       "math-verify against the answer.")
    _common(p)
    p.add_argument("--checkpoint", help="a train.run_dir whose last checkpoint to evaluate "
                   "(default: the config's model as loaded)")
    p.add_argument("--data", help="GSM8K jsonl file (overrides data.source/data.path)")
    p.add_argument("--limit", type=int, default=200, help="number of problems (default 200)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--output", help="also write the result JSON here")
    p.set_defaults(run=run_eval)
