"""A run directory: the config it was started with, per-step JSONL, W&B, the resume check.

Everything a step writes is flushed before the next step starts, and a resumed run first cuts
its JSONL files back to the checkpoint it resumes from, so a crash loses at most the steps
since the last checkpoint and never leaves a step recorded twice.
"""

from __future__ import annotations

import json
import os
import resource
import uuid
from typing import Any

import jax
import yaml

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
CONFIG_FILE = "config.yaml"
# eval.num_problems: the held-out problems, and the policy's scores on them before step 1 and
# after the last step
EVAL_FILES = {"problems": "eval_problems.jsonl", "before": "eval_before.json",
              "after": "eval_after.json"}
# keys of the config that may change between a run and its resumption
RESUMABLE_CHANGES = ("train.steps", "logging.wandb_mode", "train.keep_checkpoints")


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def device_peak_bytes() -> int | None:
    """``peak_bytes_in_use`` of this process's first device when the backend reports it (GPU,
    TPU)."""
    stats = jax.local_devices()[0].memory_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The records of a JSONL file, blank lines skipped."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate_jsonl(path: str, step: int) -> list[dict[str, Any]]:
    """Keeps the lines of a per-step JSONL file up to ``step`` (the checkpoint a run resumes
    from; later steps are run again) and returns them."""
    kept = []
    if os.path.isfile(path):
        kept = [r for r in read_jsonl(path) if r.get("step", 0) <= step]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    return kept


def write_json(path: str, value: Any) -> None:
    """Writes ``value`` as JSON through a temporary file, so a crash leaves the old file or the
    new one, never half of one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
    os.replace(tmp, path)


def read_evals(run_dir: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """A run's held-out results ``(before, after)`` (:data:`EVAL_FILES`), or None when it has
    not both."""
    paths = [os.path.join(run_dir, EVAL_FILES[which]) for which in ("before", "after")]
    if not all(os.path.isfile(p) for p in paths):
        return None
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            out.append(json.load(f))
    return out[0], out[1]


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no metrics (was the run started?)")
    return read_jsonl(path)


def diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested mappings."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += diff_keys(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else key)
        return out
    return [] if a == b else [prefix]


def check_resumable(run_dir: str, config: dict[str, Any]) -> None:
    """ValueError when ``run_dir`` holds a run whose config differs from ``config`` in more
    than :data:`RESUMABLE_CHANGES`."""
    path = os.path.join(run_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        saved = yaml.safe_load(f)
    changed = [key for key in diff_keys(saved, config) if key not in RESUMABLE_CHANGES]
    if changed:
        raise ValueError(f"train.run_dir {run_dir!r} holds a run with a different config "
                         f"(changed: {changed}); resume with the same config or choose "
                         "another run_dir")


class RunDir:
    """The files of one run: ``open`` it at the step a run resumes from, ``write`` each step,
    ``close`` at the end (also on a crash). With ``writes=False`` (every process of a
    multi-process run but the first) it touches nothing."""

    def __init__(self, path: str, config: dict[str, Any], *, wandb_mode: str = "disabled",
                 wandb_project: str = "grpo-kernels", run_name: str | None = None,
                 writes: bool = True):
        self.path = path
        self.writes = writes
        self.config = config
        self.wandb_mode, self.wandb_project, self.run_name = wandb_mode, wandb_project, run_name
        self.records: list[dict[str, Any]] = []
        self._metrics = self._samples = self.wandb = None

    def prepare(self) -> None:
        """Creates the directory, checks a run already there is resumable, saves the config."""
        if not self.writes:
            return
        os.makedirs(self.path, exist_ok=True)
        check_resumable(self.path, self.config)
        with open(os.path.join(self.path, CONFIG_FILE), "w", encoding="utf-8") as f:
            yaml.safe_dump(self.config, f, sort_keys=False)

    def open(self, step: int) -> None:
        """Cuts the JSONL files back to ``step`` and opens them (and W&B) for appending."""
        if not self.writes:
            return
        metrics = os.path.join(self.path, METRICS_FILE)
        samples = os.path.join(self.path, SAMPLES_FILE)
        self.records = truncate_jsonl(metrics, step)
        truncate_jsonl(samples, step)
        self._metrics = open(metrics, "a", encoding="utf-8")
        self._samples = open(samples, "a", encoding="utf-8")
        if self.wandb_mode != "disabled":
            self.wandb = self._wandb()

    def _wandb(self) -> Any:
        try:
            import wandb
        except ImportError:
            raise ValueError(f"logging.wandb_mode={self.wandb_mode!r} needs the wandb package "
                             "(pip install wandb), or set it to 'disabled'") from None
        id_file = os.path.join(self.path, "wandb_id")
        if os.path.isfile(id_file):
            with open(id_file, encoding="utf-8") as f:
                run_id = f.read().strip()
        else:
            run_id = uuid.uuid4().hex[:12]
            with open(id_file, "w", encoding="utf-8") as f:
                f.write(run_id)
        os.environ.setdefault("WANDB_SILENT", "true")
        return wandb.init(project=self.wandb_project, dir=self.path, mode=self.wandb_mode,
                          id=run_id, config=self.config, resume="allow",
                          name=self.run_name or os.path.basename(os.path.normpath(self.path)))

    def write(self, record: dict[str, Any], sample: dict[str, Any] | None = None) -> None:
        """One step's metrics (and a sample completion), flushed at once."""
        if not self.writes:
            return
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        if sample is not None:
            self._samples.write(json.dumps({"step": record["step"], **sample}) + "\n")
            self._samples.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step"},
                           step=record["step"])

    def close(self) -> None:
        for f in (self._metrics, self._samples):
            if f is not None:
                f.close()
        if self.wandb is not None:
            self.wandb.finish()
