"""Pieces shared by the subcommands: YAML loading, loss flags, W&B, progress."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any, Iterable, Mapping

import yaml

from grpo_kernels.config import (
    IMPORTANCE_SAMPLING_LEVELS,
    KL_ESTIMATORS,
    LOSS_TYPES,
    SAMPLER_CORRECTIONS,
    GRPOLossConfig,
)
from grpo_kernels.ops.core.dtypes import DTYPE_CHOICES, dtype_name

WANDB_MODES = ("disabled", "offline", "online")


def dtype_arg(text: str) -> str:
    """``--dtype``: any accepted spelling (bf16, bfloat16, f32, float32) -> its canonical
    name, so records and tables always say ``bfloat16`` / ``float32``."""
    try:
        return dtype_name(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be one of {list(DTYPE_CHOICES)}, "
                                         f"got {text!r}") from None


def load_yaml(path: str) -> dict[str, Any]:
    """Reads a YAML mapping; ValueError naming the file when it is missing or not a mapping."""
    if not os.path.isfile(path):
        raise ValueError(f"--config {path!r}: no such file")
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"--config {path!r}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path!r}: top level must be a mapping, got {type(data).__name__}")
    return data


def check_keys(section: str, values: Mapping[str, Any], known: Iterable[str]) -> None:
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"{section}: unknown key(s) {unknown}; known keys are {sorted(known)}")


def add_loss_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("loss options (override the config file's `loss:` section)")
    g.add_argument("--loss-type", choices=LOSS_TYPES)
    g.add_argument("--epsilon-low", type=float)
    g.add_argument("--epsilon-high", type=float)
    g.add_argument("--delta", type=float, help="upper cap of the unclipped ratio (omit: none)")
    g.add_argument("--beta", type=float)
    g.add_argument("--temperature", type=float)
    g.add_argument("--importance-sampling-level", choices=IMPORTANCE_SAMPLING_LEVELS)
    g.add_argument("--max-completion-length", type=int)
    g.add_argument("--kl-estimator", choices=KL_ESTIMATORS)
    g.add_argument("--kl-bias-correction", action="store_const", const=True, default=None,
                   help="multiply the KL by the unclipped ratio (TRL's use_bias_correction_kl)")
    g.add_argument("--sapo-temperature-pos", type=float, help="SAPO gate temperature, A > 0")
    g.add_argument("--sapo-temperature-neg", type=float, help="SAPO gate temperature, A <= 0")
    for sign in ("pos", "neg"):
        g.add_argument(f"--vespo-k-{sign}", type=float, help=f"VESPO's k for A {sign}")
        g.add_argument(f"--vespo-lambda-{sign}", type=float, help=f"VESPO's lambda for A {sign}")
    g.add_argument("--sampler-correction", choices=SAMPLER_CORRECTIONS,
                   help="correct for the sampler's log-probs (TRL's "
                   "vllm_importance_sampling_mode; random sampler log-probs in gradcheck/bench)")
    g.add_argument("--sampler-correction-min", type=float, help="C_min of the correction")
    g.add_argument("--sampler-correction-max", type=float, help="C_max (default 3)")
    g.add_argument("--off-policy-mask-threshold", type=float,
                   help="drop the policy term of sequences with A < 0 and mean "
                   "(sampler - logp) above this")
    g.add_argument("--entropy-coef", type=float,
                   help="loss minus this times the mean token entropy (default 0)")
    g.add_argument("--top-entropy-quantile", type=float,
                   help="rho in (0, 1]: only the top-rho tokens by entropy carry the policy term")


def loss_config_from(base: Mapping[str, Any], args: argparse.Namespace) -> GRPOLossConfig:
    """The config file's ``loss:`` mapping with command-line flags on top."""
    values = dict(base)
    for field in dataclasses.fields(GRPOLossConfig):
        flag = getattr(args, field.name, None)
        if flag is not None:
            values[field.name] = flag
    if values.get("loss_type") == "dr_grpo" and values.get("max_completion_length") is None:
        values["max_completion_length"] = getattr(args, "time", None)
    return GRPOLossConfig.from_dict(values)


def check_sizes(args: argparse.Namespace, positive: Iterable[str]) -> None:
    """ValueError naming the flag unless each of ``positive`` is >= 1 and ``--warmup`` >= 0."""
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")


def add_wandb_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wandb-mode", choices=WANDB_MODES, default="disabled",
                   help="log the printed metrics to Weights & Biases (default: disabled)")
    p.add_argument("--wandb-project", default="grpo-kernels")
    p.add_argument("--wandb-dir", default=None, help="directory for offline runs")


def log_wandb(args: argparse.Namespace, job: str, config: dict[str, Any],
              rows: list[dict[str, Any]]) -> None:
    """Logs each row (flat dict of the printed metrics) as one W&B step."""
    if args.wandb_mode == "disabled":
        return
    try:
        import wandb
    except ImportError:
        raise SystemExit(
            f"--wandb-mode {args.wandb_mode} needs the wandb package: "
            "pip install wandb"
        ) from None
    run = wandb.init(project=args.wandb_project, job_type=job, mode=args.wandb_mode,
                     dir=args.wandb_dir, config=config)
    for row in rows:
        run.log({k: v for k, v in row.items() if isinstance(v, (int, float, bool))})
    run.finish()


def progress(iterable: Iterable[Any], total: int, desc: str, enabled: bool = True):
    """A tqdm bar on stderr (silent when stderr is not a terminal, unless forced by env)."""
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, leave=False,
                disable=not enabled or None)


def fmt_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """Plain fixed-width table of ``columns`` for each row."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)
