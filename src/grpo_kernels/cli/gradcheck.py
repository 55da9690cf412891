"""``grpo-kernels gradcheck``: one implementation against the reference, with tolerance gates."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from grpo_kernels.cli import common
from grpo_kernels.config import CLASSIC_LOSS_TYPES, GRPOLossConfig
from grpo_kernels.ops.logits_loss import IMPLEMENTATIONS, grpo_loss
from grpo_kernels.ops.core.dtypes import parse_dtype
from grpo_kernels.ops.logits_loss.inputs import random_inputs


@dataclasses.dataclass(frozen=True)
class Tolerances:
    """Gates of one dtype.

    ``|loss - loss_ref| <= loss_atol + loss_rtol * |loss_ref|``;
    ``max|d - d_ref| <= dlogits_atol``; ``max|d - d_ref| / max|d_ref| <= dlogits_rtol``.
    """

    loss_atol: float
    loss_rtol: float
    dlogits_atol: float
    dlogits_rtol: float

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
                raise ValueError(f"tolerances.{f.name} must be a number >= 0, got {v!r}")


# float32: both sides reduce the same float32 values in a different order.
# bfloat16: both round a float32 gradient to bfloat16 once; they may land one ulp (2^-8
# relative) apart where the float32 values straddle a rounding boundary.
DEFAULT_TOLERANCES = {
    "float32": Tolerances(loss_atol=1e-5, loss_rtol=1e-5, dlogits_atol=1e-5, dlogits_rtol=1e-4),
    "bfloat16": Tolerances(loss_atol=1e-4, loss_rtol=1e-4, dlogits_atol=5e-2, dlogits_rtol=1e-2),
}


@dataclasses.dataclass(frozen=True)
class GradcheckSettings:
    batch: int = 2
    time: int = 64
    vocab: int = 1000
    dtype: str = "float32"
    seed: int = 0
    noise: float = 0.1
    logit_scale: float = 2.0


_SECTIONS = ("loss", "shape", "tolerances", "seed", "noise", "logit_scale")


def _tolerances(cfg: Mapping[str, Any]) -> dict[str, Tolerances]:
    section = cfg.get("tolerances") or {}
    common.check_keys("tolerances", section, DEFAULT_TOLERANCES)
    out = {}
    for dtype, default in DEFAULT_TOLERANCES.items():
        values = section.get(dtype) or {}
        common.check_keys(f"tolerances.{dtype}", values, dataclasses.asdict(default))
        out[dtype] = dataclasses.replace(default, **values)
    return out


def check_one(impl: str, config: GRPOLossConfig, settings: GradcheckSettings,
              tolerances: dict[str, Tolerances]) -> dict[str, Any]:
    """Runs ``impl`` and ``reference`` on the same inputs; returns the printed record."""
    dtype = parse_dtype(settings.dtype)
    dtype_name = jnp.dtype(dtype).name
    tol = tolerances[dtype_name]
    inp = random_inputs(settings.seed, settings.batch, settings.time, settings.vocab, dtype,
                        config, noise=settings.noise, logit_scale=settings.logit_scale)

    def value_and_grad(name):
        fn = lambda z: grpo_loss(z, inp.ids, inp.mask, inp.advantages, config=config,
                                 impl=name, **inp.kwargs())
        (loss, _), d = jax.jit(jax.value_and_grad(fn, has_aux=True))(inp.logits)
        return float(loss), np.asarray(d.astype(jnp.float32), np.float64)

    loss_ref, d_ref = value_and_grad("reference")
    loss_k, d_k = value_and_grad(impl)
    abs_diff = abs(loss_k - loss_ref)
    max_abs = float(np.max(np.abs(d_k - d_ref)))
    scale = float(np.max(np.abs(d_ref)))
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    finite = all(math.isfinite(x) for x in (loss_ref, loss_k, max_abs)) and bool(
        np.isfinite(d_k).all() and np.isfinite(d_ref).all())
    gates = {
        "finite": finite,
        "loss_abs": finite and abs_diff <= tol.loss_atol + tol.loss_rtol * abs(loss_ref),
        "dlogits_abs": finite and max_abs <= tol.dlogits_atol,
        "dlogits_rel": finite and max_rel <= tol.dlogits_rtol,
    }
    record = {
        "impl": impl, **dataclasses.asdict(settings), "dtype": dtype_name, **config.to_dict(),
        "loss_ref": loss_ref, "loss_kernel": loss_k, "abs_diff_loss": abs_diff,
        "max_abs_diff_dlogits": max_abs, "max_rel_diff_dlogits": max_rel,
        **{f"tol_{k}": v for k, v in dataclasses.asdict(tol).items()},
        **{f"gate_{k}": "PASS" if v else "FAIL" for k, v in gates.items()},
    }
    record["passed"] = all(gates.values())
    return record


# The 2026 family and the options that came with it, each run at token and sequence level.
# With gradcheck's noise (0.1) every cap, mask and truncation here acts on some tokens.
FAMILY_VARIANTS: tuple[dict[str, Any], ...] = (
    {"loss_type": "cispo", "epsilon_high": 1.05},
    {"loss_type": "sapo"},
    {"loss_type": "vespo", "sampler_correction": "token_truncate",
     "sampler_correction_max": 1.05},
    {"loss_type": "luspo", "beta": 0.04},
    {"sampler_correction": "token_mask", "sampler_correction_min": 0.95,
     "sampler_correction_max": 1.05},
    {"sampler_correction": "sequence_truncate", "sampler_correction_max": 1.1},
    {"off_policy_mask_threshold": 0.0},
    {"beta": 0.04, "kl_bias_correction": True, "kl_estimator": "k2"},
    {"entropy_coef": 0.05},
    {"entropy_coef": 0.05, "top_entropy_quantile": 0.2},
    {"loss_type": "dapo", "entropy_coef": 0.02, "top_entropy_quantile": 0.5,
     "sampler_correction": "sequence_mask", "sampler_correction_min": 0.5,
     "sampler_correction_max": 2.0, "off_policy_mask_threshold": 0.01, "beta": 0.04,
     "kl_bias_correction": True, "temperature": 0.7},
)


LEVELS = ("token", "sequence")


def family_configs(base: GRPOLossConfig, time: int, levels: tuple[str, ...] = LEVELS):
    """:data:`FAMILY_VARIANTS` x ``levels`` (default: token, sequence) on top of ``base``."""
    for variant, level in itertools.product(FAMILY_VARIANTS, levels):
        yield dataclasses.replace(
            base, **{"importance_sampling_level": level, "delta": None, "dual_clip": None,
                     "max_completion_length": base.max_completion_length or time, **variant})


def grid_configs(base: GRPOLossConfig, time: int):
    """The grid: TRL's classic loss_type x level x beta x delta x temperature, then
    the family's variants (f32 and bf16 by caller)."""
    for loss_type, level, beta, delta, temp in itertools.product(
        CLASSIC_LOSS_TYPES, ("token", "sequence"), (0.0, 0.04), (None, 2.0), (1.0, 0.7)
    ):
        yield dataclasses.replace(
            base, loss_type=loss_type, importance_sampling_level=level, beta=beta, delta=delta,
            temperature=temp, max_completion_length=base.max_completion_length or time,
        )
    yield from family_configs(base, time)


def _levels(text: str) -> tuple[str, ...]:
    levels = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [x for x in levels if x not in LEVELS]
    if bad or not levels:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated subset of "
                                         f"{','.join(LEVELS)}")
    return levels


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gradcheck", help="compare an implementation's loss and dlogits with the reference",
        description="Random seeded inputs (old_logps = reference logp + N(0, noise)); prints "
        "loss_ref, loss_kernel, abs_diff_loss, max_abs_diff_dlogits, max_rel_diff_dlogits and "
        "each tolerance gate. Exit 0 only if every gate passes and everything is finite.",
    )
    p.add_argument("--config", help="YAML with sections loss, shape, tolerances, seed, noise")
    p.add_argument("--impl", default="xla", choices=[i for i in IMPLEMENTATIONS if i != "reference"])
    p.add_argument("--batch", type=int)
    p.add_argument("--time", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--dtype", type=common.dtype_arg,
                   help="bf16 | bfloat16 | f32 | float32")
    p.add_argument("--seed", type=int)
    p.add_argument("--noise", type=float, help="std of old/ref logp noise (default 0.1)")
    p.add_argument("--grid", action="store_true",
                   help="run TRL's classic loss_type x level x beta{0,0.04} x delta{None,2} x "
                   "temperature{1,0.7}, then each of the CISPO/SAPO/VESPO/LUSPO, sampler "
                   "correction, off-policy mask, KL bias correction and entropy variants at "
                   "both levels; in float32 and bfloat16")
    p.add_argument("--family", action="store_true",
                   help="only the family variants of --grid (CISPO ... entropy), at both levels, "
                   "in --dtype (default float32)")
    p.add_argument("--family-levels", type=_levels, default=LEVELS, metavar="LEVELS",
                   help="comma-separated importance-sampling levels of --family (default: "
                   "token,sequence)")
    p.add_argument("--json", action="store_true", help="one JSON object per check, nothing else")
    common.add_loss_flags(p)
    common.add_wandb_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    cfg = common.load_yaml(args.config) if args.config else {}
    common.check_keys(f"--config {args.config}", cfg, _SECTIONS)
    shape = cfg.get("shape") or {}
    common.check_keys("shape", shape, ("batch", "time", "vocab", "dtype"))
    values = {**shape, **{k: cfg[k] for k in ("seed", "noise", "logit_scale") if k in cfg}}
    for name in ("batch", "time", "vocab", "dtype", "seed", "noise"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    settings = GradcheckSettings(**values)
    for name in ("batch", "time", "vocab"):
        if not isinstance(getattr(settings, name), int) or getattr(settings, name) < 1:
            raise ValueError(f"{name} must be an int >= 1, got {getattr(settings, name)!r}")
    parse_dtype(settings.dtype)
    args.time = settings.time
    config = common.loss_config_from(cfg.get("loss") or {}, args)
    tolerances = _tolerances(cfg)

    if args.grid and args.family:
        raise ValueError("--grid already holds the --family variants: pass one of them")
    if args.grid:
        jobs = [(c, dataclasses.replace(settings, dtype=d))
                for d in ("float32", "bfloat16") for c in grid_configs(config, settings.time)]
    elif args.family:
        jobs = [(c, settings) for c in family_configs(config, settings.time,
                                                      args.family_levels)]
    else:
        jobs = [(config, settings)]
    records = []
    for c, s in common.progress(jobs, len(jobs), "gradcheck", enabled=len(jobs) > 1):
        records.append(check_one(args.impl, c, s, tolerances))
    if args.json:
        for r in records:
            print(json.dumps(r))
    else:
        _print_human(records)
    common.log_wandb(args, "gradcheck", {"impl": args.impl}, records)
    return 0 if all(r["passed"] for r in records) else 1


_SHOWN = ("loss_type", "importance_sampling_level", "beta", "delta", "temperature",
          "max_completion_length")


def _options(record: dict[str, Any]) -> str:
    """The record's loss options that the table's columns do not show, where not default."""
    defaults = GRPOLossConfig()
    return " ".join(f"{f.name}={record[f.name]}" for f in dataclasses.fields(GRPOLossConfig)
                    if f.name not in _SHOWN and record[f.name] != getattr(defaults, f.name))


def _print_human(records: list[dict[str, Any]]) -> None:
    if len(records) == 1:
        r = records[0]
        for k in ("impl", "dtype", "batch", "time", "vocab", "loss_type", "importance_sampling_level",
                  "beta", "delta", "temperature", "loss_ref", "loss_kernel", "abs_diff_loss",
                  "max_abs_diff_dlogits", "max_rel_diff_dlogits"):
            print(f"{k:28s} {r[k]}")
        print(f"{'options':28s} {_options(r) or '(defaults)'}")
        for k in ("finite", "loss_abs", "dlogits_abs", "dlogits_rel"):
            tol = {"loss_abs": f"<= {r['tol_loss_atol']} + {r['tol_loss_rtol']}*|loss_ref|",
                   "dlogits_abs": f"<= {r['tol_dlogits_atol']}",
                   "dlogits_rel": f"<= {r['tol_dlogits_rtol']}", "finite": ""}[k]
            print(f"gate {k:23s} {r['gate_' + k]}  {tol}")
    else:
        cols = ["dtype", "loss_type", "importance_sampling_level", "beta", "delta", "temperature",
                "options", "abs_diff_loss", "max_abs_diff_dlogits", "max_rel_diff_dlogits",
                "passed"]
        print(common.fmt_table([{**r, "options": _options(r)} for r in records], cols))
    n_pass = sum(r["passed"] for r in records)
    print(f"gradcheck: {n_pass}/{len(records)} checks passed")
