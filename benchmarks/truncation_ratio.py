"""Step 1 of a GRPO run whose sampler truncates: the trainer's log-probs against the sampler's.

    python3 benchmarks/truncation_ratio.py                         # top_k 20, top_p 0.9
    python3 benchmarks/truncation_ratio.py --top-k 50 --top-p 0.95 --min-p 0.02 --json out.json

A trainer of ``--config`` (default: the embedded SmolLM2-135M on arithmetic problems) samples
step 1's completions with ``rollout.top_k / top_p / min_p``; the sampler returns the log-probs of
the distribution it drew from (vLLM's processed log-probs). The same weights then score the same
tokens twice, as the trainer's log-prob pass does: with ``loss.truncation: true`` (the loss and
the pass take the sampler's truncation) and ``false`` (the whole vocabulary, what a trainer that
ignores the truncation computes). At step 1 policy and sampler are one model, so the importance
ratio :math:`e^{\\log\\pi_{trainer} - \\log\\pi_{sampler}}` should be 1 on every token; what is
left besides the truncation is the two programs' numerics (the sampler's bf16 key/value cache
against the update's forward). Per arm: the mean ratio over the completion tokens, the mean
absolute log-ratio, and the share of tokens the trainer finds outside the kept set.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import numpy as np
import yaml


def arm(values: dict, truncation: bool) -> dict:
    """The step-1 figures of one trainer: ``loss.truncation`` set to ``truncation``."""
    from grpo_kernels.rl.config import TrainConfig
    from grpo_kernels.rl.trainer import Trainer

    values = {**values, "loss": {**values.get("loss", {}), "truncation": truncation}}
    trainer = Trainer(TrainConfig.from_dict(values), progress=False)
    batch, _, _ = trainer.rollout(0)
    mask = batch.mask.astype(bool)
    trainer_logps = trainer.token_logps(trainer.state, batch)
    log_ratio = (trainer_logps - batch.sampler_logps)[mask]
    return {"loss.truncation": truncation, "tokens": int(mask.sum()),
            "ratio_mean": float(np.mean(np.exp(log_ratio))),
            "abs_log_ratio_mean": float(np.mean(np.abs(log_ratio))),
            "log_ratio_mean": float(np.mean(log_ratio)),
            "completions": batch.rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--config", default="configs/default.yaml",
                   help="the trainer's YAML (default: configs/default.yaml)")
    p.add_argument("--top-k", type=int, default=20, help="rollout.top_k (default 20)")
    p.add_argument("--top-p", type=float, default=0.9, help="rollout.top_p (default 0.9)")
    p.add_argument("--min-p", type=float, help="rollout.min_p (default: off)")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    try:
        with open(args.config) as f:
            values = yaml.safe_load(f)
    except OSError as e:
        p.error(f"--config: {e}")
    values["rollout"] = {**values.get("rollout", {}), "top_k": args.top_k, "top_p": args.top_p,
                         "min_p": args.min_p}
    values["logging"] = {"wandb_mode": "disabled"}
    with tempfile.TemporaryDirectory() as run_dir:
        values["train"] = {**values.get("train", {}), "run_dir": run_dir}
        try:
            from grpo_kernels.rl.config import TrainConfig
            TrainConfig.from_dict(values)
        except ValueError as e:
            p.error(str(e))
        rows = []
        for truncation in (True, False):
            row = {**arm(values, truncation), "top_k": args.top_k, "top_p": args.top_p,
                   "min_p": args.min_p, "config": args.config}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| loss.truncation | tokens | mean ratio | mean log-ratio | mean abs log-ratio |\n"
          "|---|---|---|---|---|")
    for r in rows:
        print(f"| {str(r['loss.truncation']).lower()} | {r['tokens']} | {r['ratio_mean']:.5f} | "
              f"{r['log_ratio_mean']:+.2e} | {r['abs_log_ratio_mean']:.2e} |")
    if args.json:
        from grpo_kernels.rl.run_dir import write_json
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
