"""The GRPO loop: rollout -> rewards -> advantages -> update, with metrics and checkpoints.

One step: sample ``rollout.batch_size`` completions (``num_generations`` per prompt) from the
current policy, score them, form group advantages, then ``train.ppo_epochs`` optimizer updates on
that batch, each accumulating gradients over micro-batches. The loss implementation is
``loss.impl``; everything else is the same for every implementation, so an A/B of two runs with
one seed differs only in the loss.

Resuming: the problems of step ``s`` and its sampling seed depend only on ``(seed, s)``, and a
checkpoint holds the parameters and optimizer state, so a run restarted with the same command
continues from its last checkpoint exactly as if it had never stopped.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import resource
import time
import uuid
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx

from grpo_kernels.models.config import ModelConfig
from grpo_kernels.models.decoder import Decoder
from grpo_kernels.models.sampling import generate
from grpo_kernels.rl import data as data_lib
from grpo_kernels.rl import rewards as rewards_lib
from grpo_kernels.rl.config import TrainConfig
from grpo_kernels.rl.policy import METRIC_NAMES, Batch, make_programs, micro_scale

Array = jax.Array
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
CONFIG_FILE = "config.yaml"
# keys of the config that may change between a run and its resumption
RESUMABLE_CHANGES = ("train.steps", "logging.wandb_mode")


# --- model --------------------------------------------------------------------------------

def _dtype(name: str) -> Any:
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def _truncate(model: Decoder, num_layers: int | None) -> Decoder:
    if num_layers is None or num_layers >= model.config.num_layers:
        return model
    model.layers = nnx.List(list(model.layers)[:num_layers])
    model.config = model.config.replace(num_layers=num_layers)
    return model


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str, mtime: float) -> Any:
    """The tokenizer of a GGUF file or tokenizer directory, read once per process (a GGUF's
    vocabulary takes seconds to parse); ``mtime`` keys a changed file anew."""
    from grpo_kernels.models.tokenizer import TextTokenizer

    del mtime
    return (TextTokenizer.from_gguf(path) if os.path.isfile(path)
            else TextTokenizer.from_dir(path))


def load_policy(config: TrainConfig) -> tuple[Decoder, Any]:
    """``(model, tokenizer)`` that ``config.model`` names.

    Raises:
      ValueError: a missing path (naming the key, the path and what it should hold), or what
        the loaders raise for bad files.
    """
    from grpo_kernels.models.gguf_loader import load_gguf, smollm2_path
    from grpo_kernels.models.hf import load_hf_checkpoint

    m = config.model
    dtypes = dict(param_dtype=_dtype(m.param_dtype), compute_dtype=_dtype(m.compute_dtype))
    if m.source in ("smollm2", "gguf"):
        path = smollm2_path() if m.source == "smollm2" else m.path
        if not os.path.isfile(path):
            raise ValueError(f"model.path {path!r}: no such file (expected a .gguf file)")
        _, model = load_gguf(path, remat=m.remat, **dtypes)
        default_tokenizer = path
    elif m.source == "hf":
        if not os.path.isdir(m.path):
            raise ValueError(f"model.path {m.path!r}: no such directory (expected a Hugging "
                             "Face checkpoint: config.json and *.safetensors)")
        _, model = load_hf_checkpoint(m.path, remat=m.remat, **dtypes)
        default_tokenizer = m.path
    else:
        default_tokenizer = None
    tok_path = m.tokenizer or default_tokenizer
    if not os.path.exists(tok_path):
        raise ValueError(f"model.tokenizer {tok_path!r}: no such file or directory (expected a "
                         "directory with tokenizer.json, or a GGUF file)")
    tokenizer = _tokenizer(tok_path, os.path.getmtime(tok_path))
    if m.source == "random":
        shape = dict(m.random)
        shape.setdefault("vocab_size", tokenizer.tokenizer.get_vocab_size())
        try:
            model_config = ModelConfig(**shape, **dtypes)
        except TypeError as e:
            raise ValueError(f"model.random: {e}") from None
        model = Decoder(model_config, nnx.Rngs(config.seed), remat=m.remat)
    return _truncate(model, m.num_layers), tokenizer


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """AdamW with global-norm clipping and a warmup-cosine schedule over every update."""
    o = config.optim
    updates = config.train.steps * config.train.ppo_epochs
    warmup = min(o.warmup_steps, max(updates - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else o.learning_rate, peak_value=o.learning_rate,
        warmup_steps=warmup, decay_steps=max(updates, warmup + 1),
        end_value=o.learning_rate * o.end_lr_ratio)
    return optax.chain(optax.clip_by_global_norm(o.max_grad_norm),
                       optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps,
                                   weight_decay=o.weight_decay))


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of step ``step``: a function of ``(seed, step)`` only."""
    return int(np.random.default_rng([seed, step]).integers(2 ** 31 - 1))


# --- bookkeeping ----------------------------------------------------------------------------

def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def device_peak_bytes() -> int | None:
    """``peak_bytes_in_use`` of the first device when the backend reports it (GPU, TPU)."""
    stats = jax.devices()[0].memory_stats()
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


class MetricsLog:
    """Per-step metrics: a JSONL file (flushed every step) and optionally W&B."""

    def __init__(self, run_dir: str, config: TrainConfig, resume_step: int):
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.records = truncate_jsonl(self.path, resume_step)
        self.file = open(self.path, "a", encoding="utf-8")
        self.wandb = None
        mode = config.logging.wandb_mode
        if mode != "disabled":
            try:
                import wandb
            except ImportError:
                raise ValueError(f"logging.wandb_mode={mode!r} needs the wandb package "
                                 "(pip install wandb), or set it to 'disabled'") from None
            id_file = os.path.join(run_dir, "wandb_id")
            if os.path.isfile(id_file):
                with open(id_file, encoding="utf-8") as f:
                    run_id = f.read().strip()
            else:
                run_id = uuid.uuid4().hex[:12]
                with open(id_file, "w", encoding="utf-8") as f:
                    f.write(run_id)
            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb = wandb.init(
                project=config.logging.wandb_project, dir=run_dir, mode=mode, id=run_id,
                name=config.logging.run_name or os.path.basename(os.path.normpath(run_dir)),
                config=config.to_dict(), resume="allow")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step"},
                           step=record["step"])

    def close(self) -> None:
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no metrics (was the run started?)")
    return read_jsonl(path)


def _check_resumable(run_dir: str, config: TrainConfig) -> None:
    path = os.path.join(run_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        saved = yaml.safe_load(f)
    new = config.to_dict()
    changed = [key for key in _diff_keys(saved, new) if key not in RESUMABLE_CHANGES]
    if changed:
        raise ValueError(f"train.run_dir {run_dir!r} holds a run with a different config "
                         f"(changed: {changed}); resume with the same config or choose "
                         "another run_dir")


def _diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += _diff_keys(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else key)
        return out
    return [] if a == b else [prefix]


# --- the trainer ----------------------------------------------------------------------------

class Trainer:
    """A GRPO run of ``config``; :meth:`run` trains (resuming from ``train.run_dir``)."""

    def __init__(self, config: TrainConfig, *, progress: bool = True):
        self.config = config
        self.progress = progress
        c = config
        self.problems = data_lib.load_problems(c.data.source, c.data.path, c.data.difficulty,
                                               c.data.num_problems, c.seed)
        self.model, self.tokenizer = load_policy(c)
        self.loss_config = c.loss_config()
        self.graphdef, self.state = nnx.split(self.model)
        self.mesh, self.sharding = self._mesh()
        if self.mesh is not None:  # weights replicated; rows split over the batch axes
            from jax.sharding import NamedSharding, PartitionSpec

            self.state = jax.device_put(self.state, NamedSharding(self.mesh, PartitionSpec()))
        self.ref_state = self.state if self.loss_config.beta > 0 else None
        self.tx = make_optimizer(c)
        self.opt_state = self.tx.init(self.state)
        self._programs: dict[Any, Any] = {}
        self._apply = jax.jit(self._apply_updates)
        self._add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
        self.update_temp_bytes = 0

    def _mesh(self) -> tuple[Any, Any]:
        m = self.config.mesh
        if m.shape is None:
            return None, None
        from grpo_kernels.sharding import ShardingSpec, mesh_from_shape

        mesh = mesh_from_shape(tuple(m.shape.values()), tuple(m.shape))
        return mesh, ShardingSpec(batch_axes=tuple(m.batch_axes), vocab_axis=m.vocab_axis)

    # --- programs -----------------------------------------------------------------------

    def _apply_updates(self, state, opt_state, grads):
        # optax mixes Python floats and int32 step counts (fine under standard promotion,
        # refused under the strict promotion our tests run with)
        with jax.numpy_dtype_promotion("standard"):
            norm = optax.tree.norm(grads)
            updates, opt_state = self.tx.update(grads, opt_state, state)
            return optax.apply_updates(state, updates), opt_state, norm

    def _compiled(self, kind: str, prompt_width: int, args: tuple) -> Callable:
        """The compiled ``grad`` / ``logp`` program for these argument shapes (compiled once;
        its planned temp bytes recorded for ``grad``)."""
        shapes = jax.tree.map(lambda x: (x.shape, str(x.dtype)), args)
        key = (kind, prompt_width, str(shapes))
        if key not in self._programs:
            grad_fn, logp_fn = make_programs(
                self.graphdef, impl=self.config.loss.impl, config=self.loss_config,
                prompt_width=prompt_width, mesh=self.mesh, sharding=self.sharding)
            fn = grad_fn if kind == "grad" else logp_fn
            compiled = jax.jit(fn).lower(*args).compile()
            if kind == "grad":
                analysis = compiled.memory_analysis()
                if analysis is not None:
                    self.update_temp_bytes = max(self.update_temp_bytes,
                                                 int(analysis.temp_size_in_bytes))
            self._programs[key] = compiled
        return self._programs[key]

    def _put(self, mb: dict[str, Any]) -> dict[str, Any]:
        if self.mesh is None:
            return {k: None if v is None else jnp.asarray(v) for k, v in mb.items()}
        from jax.sharding import NamedSharding, PartitionSpec

        rows = NamedSharding(self.mesh, PartitionSpec(tuple(self.config.mesh.batch_axes)))
        return {k: None if v is None else jax.device_put(v, rows) for k, v in mb.items()}

    def token_logps(self, state: Any, batch: Batch) -> np.ndarray:
        """Completion log-probs ``[N, C]`` of the policy ``state`` (no gradient)."""
        size = self.config.train.micro_batch_size
        out = []
        for start in range(0, batch.rows, size):
            mb = self._put(batch.micro(start, size))
            fn = self._compiled("logp", batch.prompt_width, (state, mb))
            out.append(np.asarray(fn(state, mb)))
        return np.concatenate(out) * batch.mask

    def update(self, batch: Batch) -> dict[str, float]:
        """``ppo_epochs`` optimizer updates on ``batch``; returns the update's metrics."""
        c = self.config
        size, rows = c.train.micro_batch_size, batch.rows
        total_tokens = int(batch.mask.sum())
        num_items = jnp.float32(max(total_tokens, 1))
        if c.train.ppo_epochs > 1:
            batch = dataclasses.replace(batch, old_logps=self.token_logps(self.state, batch))
        if self.ref_state is not None:
            batch = dataclasses.replace(batch, ref_logps=self.token_logps(self.ref_state, batch))
        first: dict[str, float] = {}
        for epoch in range(c.train.ppo_epochs):
            grads, loss, sums = None, 0.0, dict.fromkeys(METRIC_NAMES, 0.0)
            for start in range(0, rows, size):
                host = batch.micro(start, size)
                tokens = int(host["mask"].sum())
                scale = micro_scale(self.loss_config, len(host["mask"]), tokens, rows,
                                    total_tokens)
                mb = self._put(host)
                args = (self.state, mb, jnp.float32(scale), num_items)
                fn = self._compiled("grad", batch.prompt_width, args)
                (part, metrics), g = fn(*args)
                grads = g if grads is None else self._add(grads, g)
                loss += float(part)
                for name in METRIC_NAMES:  # token-weighted means over the batch
                    sums[name] += float(metrics[name]) * tokens
            self.state, self.opt_state, norm = self._apply(self.state, self.opt_state, grads)
            if epoch == 0:
                first = {"loss": loss, "grad_norm": float(norm),
                         **{name: sums[name] / max(total_tokens, 1) for name in METRIC_NAMES}}
        return first

    # --- one step -----------------------------------------------------------------------

    def rollout(self, step: int) -> tuple[Batch, dict[str, Any], dict[str, Any]]:
        """Samples, scores and forms the advantages of step ``step`` (0-based)."""
        c = self.config
        g = c.rollout.num_generations
        indices = data_lib.step_indices(step, c.rollout.batch_size // g, len(self.problems),
                                        c.seed)
        problems = [self.problems[i] for i in indices]
        prompts = [data_lib.prompt_ids(self.tokenizer, c.data.system_prompt, p.question)
                   for p in problems]
        nnx.update(self.model, self.state)
        gen = generate(self.model, prompts, num_generations=g,
                       max_new_tokens=c.rollout.max_new_tokens,
                       temperature=c.rollout.temperature, top_k=c.rollout.top_k,
                       top_p=c.rollout.top_p, eos_ids=self.tokenizer.eos_ids,
                       pad_id=self.tokenizer.pad_id, seed=step_seed(c.seed, step))
        texts = [self.tokenizer.decode(ids[m == 1]) for ids, m in zip(gen.ids, gen.mask)]
        rows = [p for p in problems for _ in range(g)]
        functions = [(f.name, f.weight) for f in c.rewards.functions]
        reward, parts = rewards_lib.score(texts, rows, functions)
        advantages = rewards_lib.group_advantages(reward, g, c.rewards.scale_rewards)
        batch = Batch(ids=np.concatenate([gen.prompt_ids, gen.ids], axis=1),
                      attention=np.concatenate([gen.prompt_mask, gen.mask], axis=1),
                      mask=gen.mask, advantages=advantages,
                      prompt_width=int(gen.prompt_ids.shape[1]))
        lengths = gen.mask.sum(axis=1)
        ended = np.isin(gen.ids, self.tokenizer.eos_ids).any(axis=1)
        metrics = {"reward/mean": float(reward.mean()), "reward/std": float(reward.std()),
                   **{f"reward/{name}": float(v.mean()) for name, v in parts.items()},
                   "completion/length_mean": float(lengths.mean()),
                   "completion/length_max": int(lengths.max()),
                   "completion/truncated_ratio": float(1 - ended.mean()),
                   "tokens": int(gen.prompt_mask.sum() + gen.mask.sum())}
        sample = {"question": problems[0].question, "answer": problems[0].answer,
                  "completion": texts[0], "reward": float(reward[0])}
        return batch, metrics, sample

    def train_step(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        t0 = time.perf_counter()
        batch, rollout_metrics, sample = self.rollout(step)
        t1 = time.perf_counter()
        update_metrics = self.update(batch)
        jax.block_until_ready(self.state)
        t2 = time.perf_counter()
        record = {"step": step + 1, **rollout_metrics, **update_metrics,
                  "time/train/rollout_s": t1 - t0, "time/train/update_s": t2 - t1,
                  "time/train/step_s": t2 - t0}
        return record, sample

    # --- checkpoints ----------------------------------------------------------------------

    def _manager(self) -> Any:
        import orbax.checkpoint as ocp

        directory = os.path.abspath(os.path.join(self.config.train.run_dir, "checkpoints"))
        return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=self.config.train.keep_checkpoints, create=True))

    def _tree(self) -> dict[str, Any]:
        return {"params": jax.tree.leaves(self.state), "opt": jax.tree.leaves(self.opt_state)}

    def save(self, manager: Any, step: int) -> None:
        import orbax.checkpoint as ocp

        manager.save(step, args=ocp.args.StandardSave(self._tree()), force=True)
        manager.wait_until_finished()

    def restore(self, manager: Any = None) -> int:
        """Loads the latest checkpoint of ``run_dir``; returns its step (0 when there is
        none)."""
        import orbax.checkpoint as ocp

        manager = manager or self._manager()
        step = manager.latest_step()
        if step is None:
            return 0
        tree = manager.restore(step, args=ocp.args.StandardRestore(self._tree()))
        self.state = jax.tree.unflatten(jax.tree.structure(self.state), tree["params"])
        self.opt_state = jax.tree.unflatten(jax.tree.structure(self.opt_state), tree["opt"])
        return int(step)

    # --- the loop -------------------------------------------------------------------------

    def run(self, stop_after: int | None = None) -> list[dict[str, Any]]:
        """Trains to ``train.steps`` (from the last checkpoint in ``run_dir``, if any).

        Args:
          stop_after: Stop (without a checkpoint) after this many steps in total, as a crash
            would; for resume tests.

        Returns:
          The metrics records of the steps run now.
        """
        from tqdm.auto import tqdm

        c = self.config
        run_dir = c.train.run_dir
        os.makedirs(run_dir, exist_ok=True)
        _check_resumable(run_dir, c)
        with open(os.path.join(run_dir, CONFIG_FILE), "w", encoding="utf-8") as f:
            yaml.safe_dump(c.to_dict(), f, sort_keys=False)
        manager = self._manager()
        start = self.restore(manager)
        log = MetricsLog(run_dir, c, start)
        samples_path = os.path.join(run_dir, SAMPLES_FILE)
        truncate_jsonl(samples_path, start)
        samples = open(samples_path, "a", encoding="utf-8")
        step_times = [r.get("time/train/step_s", 0.0) for r in log.records][-10:]
        records = []
        bar = tqdm(total=c.train.steps, initial=start, desc=f"train {c.loss.impl}",
                   disable=not self.progress, dynamic_ncols=True)
        step = start
        try:
            for step in range(start, c.train.steps):
                if stop_after is not None and step >= stop_after:
                    break
                record, sample = self.train_step(step)
                step_times = (step_times + [record["time/train/step_s"]])[-10:]
                record["time/train/step_avg_last10_s"] = float(np.mean(step_times))
                record["throughput/tokens_per_s"] = record["tokens"] / record["time/train/step_s"]
                record["memory/update_temp_bytes"] = self.update_temp_bytes
                record["memory/peak_rss_bytes"] = peak_rss_bytes()
                device = device_peak_bytes()
                if device is not None:
                    record["memory/device_peak_bytes"] = device
                record["memory/peak_bytes"] = device if device is not None \
                    else self.update_temp_bytes
                log.write(record)
                samples.write(json.dumps({"step": step + 1, **sample}) + "\n")
                samples.flush()
                records.append(record)
                bar.update(1)
                bar.set_postfix(reward=f"{record['reward/mean']:.3f}",
                                loss=f"{record['loss']:.4f}",
                                step_s=f"{record['time/train/step_s']:.1f}")
                done = step + 1
                if done % c.train.checkpoint_every == 0 or done == c.train.steps:
                    self.save(manager, done)
        except KeyboardInterrupt:  # keep what finished: a checkpoint at the last full step
            done = len(records) + start
            if done > start:
                self.save(manager, done)
            raise
        finally:
            bar.close()
            log.close()
            samples.close()
            manager.close()
        return records
