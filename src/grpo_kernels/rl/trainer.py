"""The GRPO loop: rollout -> rewards -> advantages -> update, with metrics and checkpoints.

One step: sample ``rollout.batch_size`` completions (``num_generations`` per prompt) from the
current policy, score them, form group advantages, then ``train.ppo_epochs`` optimizer updates on
that batch, each accumulating gradients over micro-batches. The loss implementation is
``loss.head`` and ``loss.impl`` (with its options from ``loss.kernel``); everything else is the
same for every implementation, so an A/B of two runs with one seed differs only in the loss.

Resuming: the problems of step ``s`` and its sampling seed depend only on ``(seed, s)``, and a
checkpoint holds the parameters and optimizer state, so a run restarted with the same command
continues from its last checkpoint exactly as if it had never stopped.

Held-out accuracy: with ``eval.num_problems`` set, the policy's greedy accuracy on held-out
problems (disjoint from the training pool) is measured before the first step and after the
last, and written to the run directory (:data:`grpo_kernels.rl.run_dir.EVAL_FILES`) as soon as
each is known.

Non-finite steps: each micro-batch's loss and gradient are checked on the host before they
count; the first that is not finite ends the step's update without applying it, so the
parameters and optimizer state stay bit for bit what they were, and the step's record says
``update/skipped`` with the reason. ``train.max_skipped_steps`` such steps in a row raise
:class:`NonFiniteError`, leaving the checkpoints as they were. (optax's ``apply_if_finite``
decides inside the optimizer instead: it keeps counters in the optimizer state, whose
checkpoints would then change shape, and cannot say which micro-batch failed.)
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from grpo_kernels.models.decoder import Decoder
from grpo_kernels.models.loading import load_policy as _load_policy
from grpo_kernels.models.sampling import generate
from grpo_kernels.ops.core.dtypes import parse_dtype
from grpo_kernels.rl import data as data_lib
from grpo_kernels.rl import kernel as kernel_lib
from grpo_kernels.rl import processes
from grpo_kernels.rl import rewards as rewards_lib
from grpo_kernels.rl import rollout as rollout_lib
from grpo_kernels.rl.evaluate import evaluate, evaluate_into, held_out
from grpo_kernels.rl.checkpoint import Checkpoints
from grpo_kernels.rl.config import TrainConfig
from grpo_kernels.rl.optim import make_optimizer
from grpo_kernels.rl.policy import (METRIC_NAMES, Batch, make_programs, micro_config,
                                    micro_scale)
from grpo_kernels.rl.run_dir import RunDir, device_peak_bytes, peak_rss_bytes

Array = jax.Array


def load_policy(config: TrainConfig) -> tuple[Decoder, Any]:
    """``(model, tokenizer)`` that ``config.model`` names (:func:`grpo_kernels.models.loading.
    load_policy` with the section's fields)."""
    return _load_policy(**dataclasses.asdict(config.model), seed=config.seed)


class NonFiniteError(RuntimeError):
    """``train.max_skipped_steps`` consecutive steps had a non-finite loss or gradient."""


def _all_finite(tree: Any) -> Array:
    """Whether every element of every leaf of ``tree`` is finite (one boolean scalar)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


# --- the trainer ----------------------------------------------------------------------------

class Trainer:
    """A GRPO run of ``config``; :meth:`run` trains (resuming from ``train.run_dir``)."""

    def __init__(self, config: TrainConfig, *, progress: bool = True):
        self.config = config
        self.progress = progress
        c = config
        # impl 'auto' resolved once, here, so that loss.kernel's entry for it applies
        self.loss_impl, self.loss_options = kernel_lib.resolve(c.loss.head, c.loss.impl,
                                                               c.loss.kernel)
        self.problems = data_lib.load_problems(c.data.source, c.data.path, c.data.difficulty,
                                               c.data.num_problems, c.seed)
        self.held_out = held_out(c, self.problems) if c.eval.num_problems else []
        self.model, self.tokenizer = load_policy(c)
        self.loss_config = c.loss_config()
        # what each micro-batch's loss runs with: TRL's accumulation (rl.policy)
        self.micro_batches = c.rollout.batch_size // c.train.micro_batch_size
        self.micro_loss_config = micro_config(self.loss_config, self.micro_batches)
        self.graphdef, self.state = nnx.split(self.model)
        self.mesh, self.sharding = self._mesh()
        if self.mesh is not None:  # weights replicated; rows split over the batch axes
            self.state = jax.device_put(self.state, NamedSharding(self.mesh, PartitionSpec()))
        self.ref_state = self.state if self.loss_config.beta > 0 else None
        self.tx = make_optimizer(c)
        self.opt_state = self.tx.init(self.state)
        if self.mesh is not None:  # optax's step counts too: global arrays, as Orbax saves them
            self.opt_state = jax.device_put(self.opt_state, NamedSharding(self.mesh,
                                                                          PartitionSpec()))
        self._programs: dict[Any, Any] = {}
        # On a mesh the weights and moments stay replicated: the compiled update programs take
        # them so, and a vocabulary-split dW would otherwise leave the tied embedding split.
        self._apply = jax.jit(self._apply_updates, out_shardings=None if self.mesh is None
                              else NamedSharding(self.mesh, PartitionSpec()))
        self._add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
        self._finite = jax.jit(_all_finite)
        self.update_temp_bytes = 0

    def _mesh(self) -> tuple[Any, Any]:
        m = self.config.mesh
        if jax.process_count() > 1 and (m.shape is None
                                        or np.prod(list(m.shape.values())) != jax.device_count()):
            raise ValueError(f"mesh.shape: a run over {jax.process_count()} processes needs a "
                             f"mesh over all {jax.device_count()} devices, got {m.shape}")
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
                self.graphdef, head=self.config.loss.head, impl=self.loss_impl,
                config=self.micro_loss_config, prompt_width=prompt_width, mesh=self.mesh,
                sharding=self.sharding, options=self.loss_options,
                logits_dtype=parse_dtype(self.config.loss.logits_dtype))
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
        rows = NamedSharding(self.mesh, PartitionSpec(tuple(self.config.mesh.batch_axes)))
        return {k: None if v is None else jax.device_put(v, rows) for k, v in mb.items()}

    def token_logps(self, state: Any, batch: Batch) -> np.ndarray:
        """Completion log-probs ``[N, C]`` of the policy ``state`` (no gradient)."""
        size = self.config.train.micro_batch_size
        out = []
        for start in range(0, batch.rows, size):
            mb = self._put(batch.micro(start, size))
            fn = self._compiled("logp", batch.prompt_width, (state, mb))
            out.append(processes.to_host(fn(state, mb)))
        return np.concatenate(out) * batch.mask

    def update(self, batch: Batch) -> dict[str, float]:
        """``ppo_epochs`` optimizer updates on ``batch``; returns the update's metrics."""
        c = self.config
        size, rows = c.train.micro_batch_size, batch.rows
        if rows != size * self.micro_batches:
            raise ValueError(f"update: a batch of {rows} rows, expected rollout.batch_size = "
                             f"{size * self.micro_batches}")
        total_tokens = int(batch.mask.sum())
        num_items = jnp.float32(max(total_tokens, 1))
        if c.train.ppo_epochs > 1:
            batch = dataclasses.replace(batch, old_logps=self.token_logps(self.state, batch))
        if self.ref_state is not None:
            batch = dataclasses.replace(batch, ref_logps=self.token_logps(self.ref_state, batch))
        first: dict[str, Any] = {"update/skipped": 0}
        for epoch in range(c.train.ppo_epochs):
            grads, loss, sums = None, 0.0, dict.fromkeys(METRIC_NAMES, 0.0)
            for index, start in enumerate(range(0, rows, size)):
                host = batch.micro(start, size)
                tokens = int(host["mask"].sum())
                scale = micro_scale(self.micro_loss_config, len(host["mask"]), rows)
                mb = self._put(host)
                args = (self.state, mb, jnp.float32(scale), num_items)
                fn = self._compiled("grad", batch.prompt_width, args)
                (part, metrics), g = fn(*args)
                part = float(part)
                bad = ("loss" if not math.isfinite(part)
                       else None if bool(self._finite(g)) else "gradient")
                if bad is not None:  # nothing of this epoch reaches the parameters
                    reason = (f"non-finite {bad} in micro-batch {index + 1} of "
                              f"{self.micro_batches}, epoch {epoch + 1}")
                    nan = float("nan")
                    if epoch == 0:
                        first.update({"loss": nan, "grad_norm": nan,
                                      **dict.fromkeys(METRIC_NAMES, nan)})
                    first.update({"update/skipped": 1, "update/skip_reason": reason})
                    return first
                grads = g if grads is None else self._add(grads, g)
                loss += part
                for name in METRIC_NAMES:  # token-weighted means over the batch
                    sums[name] += float(metrics[name]) * tokens
            self.state, self.opt_state, norm = self._apply(self.state, self.opt_state, grads)
            if epoch == 0:
                first.update({"loss": loss, "grad_norm": float(norm),
                              **{name: sums[name] / max(total_tokens, 1)
                                 for name in METRIC_NAMES}})
        return first

    # --- one step -----------------------------------------------------------------------

    def rollout(self, step: int) -> tuple[Batch, dict[str, Any], dict[str, Any]]:
        """Samples, scores and forms the advantages of step ``step`` (0-based)."""
        c = self.config
        g = c.rollout.num_generations
        indices = data_lib.step_indices(step, c.rollout.batch_size // g, len(self.problems),
                                        c.seed)
        problems = [self.problems[i] for i in indices]
        # this process's share (all of them in a one-process run); _gather joins the shares
        problems = problems[processes.my_slice(
            len(problems), "rollout.batch_size / rollout.num_generations")]
        prompts = [data_lib.prompt_ids(self.tokenizer, c.data.system_prompt, p.question)
                   for p in problems]
        nnx.update(self.model, processes.local_copy(self.state))
        gen = generate(self.model, prompts, num_generations=g,
                       max_new_tokens=c.rollout.max_new_tokens,
                       temperature=c.rollout.temperature, top_k=c.rollout.top_k,
                       top_p=c.rollout.top_p, min_p=c.rollout.min_p,
                       eos_ids=self.tokenizer.eos_ids, pad_id=self.tokenizer.pad_id,
                       seed=rollout_lib.step_seed(c.seed, step, jax.process_index()))
        texts = [self.tokenizer.decode(ids[m == 1]) for ids, m in zip(gen.ids, gen.mask)]
        reward, parts, sample = rollout_lib.score(texts, problems, g, c.rewards.functions)
        gen, reward, parts = self._gather(gen, reward, parts)
        advantages = rewards_lib.group_advantages(reward, g, c.rewards.scale_rewards)
        batch = rollout_lib.to_batch(gen, advantages)
        return batch, rollout_lib.metrics(gen, reward, parts, self.tokenizer.eos_ids), sample

    def _gather(self, gen: Any, reward: np.ndarray,
                parts: dict[str, np.ndarray]) -> tuple[Any, np.ndarray, dict[str, np.ndarray]]:
        """Every process's rollout rows, in process order (unchanged in a one-process run)."""
        names = [f.name for f in dataclasses.fields(gen)]
        rows = processes.gather_rows(
            {**{k: getattr(gen, k) for k in names}, "reward": reward,
             **{f"part/{k}": v for k, v in parts.items()}},
            left_pad={"prompt_ids": self.tokenizer.pad_id, "prompt_mask": 0})
        gen = type(gen)(**{k: rows[k] for k in names})
        return gen, rows["reward"], {k: rows[f"part/{k}"] for k in parts}

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

    # --- held-out evaluation ------------------------------------------------------------

    def evaluate(self, step: int) -> dict[str, Any]:
        """Greedy accuracy of the current policy on the held-out problems
        (:func:`grpo_kernels.rl.evaluate.evaluate`), tagged with ``step``."""
        c = self.config
        nnx.update(self.model, processes.local_copy(self.state))
        result = evaluate(self.model, self.tokenizer, self.held_out,
                          system_prompt=c.data.system_prompt,
                          max_new_tokens=c.eval.max_new_tokens or c.rollout.max_new_tokens,
                          batch_size=c.eval.batch_size,
                          progress=self.progress and processes.is_primary())
        return {"step": step, **result}

    def _evaluate_into(self, which: str, step: int) -> None:
        """:func:`grpo_kernels.rl.evaluate.evaluate_into` of :meth:`evaluate` into the run
        directory."""
        evaluate_into(self.config.train.run_dir, which, step, self.evaluate, self.held_out,
                      processes.is_primary())

    # --- checkpoints ----------------------------------------------------------------------

    def checkpoints(self) -> Checkpoints:
        return Checkpoints(self.config.train.run_dir, self.config.train.keep_checkpoints)

    def restore(self, checkpoints: Checkpoints | None = None) -> int:
        """Loads the latest checkpoint of ``run_dir``; returns its step (0 when there is
        none)."""
        ckpt = checkpoints or self.checkpoints()
        try:
            step, self.state, self.opt_state = ckpt.restore(self.state, self.opt_state)
        finally:
            if checkpoints is None:
                ckpt.close()
        return step

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
        primary = processes.is_primary()  # the others train and checkpoint, and write nothing
        run = RunDir(c.train.run_dir, c.to_dict(), wandb_mode=c.logging.wandb_mode,
                     wandb_project=c.logging.wandb_project, run_name=c.logging.run_name,
                     writes=primary)
        run.prepare()
        ckpt = self.checkpoints()
        records: list[dict[str, Any]] = []
        bar = None
        skipped_in_row = 0
        try:
            start = self.restore(ckpt)
            run.open(start)
            if self.held_out and start == 0:
                self._evaluate_into("before", 0)
            step_times = [r.get("time/train/step_s", 0.0) for r in run.records][-10:]
            bar = tqdm(total=c.train.steps, initial=start, desc=f"train {c.loss.arm}",
                       disable=not (self.progress and primary), dynamic_ncols=True)
            for step in range(start, c.train.steps):
                if stop_after is not None and step >= stop_after:
                    break
                record, sample = self.train_step(step)
                step_times = (step_times + [record["time/train/step_s"]])[-10:]
                record.update(self._bookkeeping(record, step_times))
                run.write(record, sample)
                records.append(record)
                if record["update/skipped"]:
                    skipped_in_row += 1
                    if primary:
                        tqdm.write(f"step {step + 1}: update skipped ("
                                   f"{record['update/skip_reason']})", file=sys.stderr)
                    if skipped_in_row >= c.train.max_skipped_steps:
                        saved = ckpt.steps()
                        raise NonFiniteError(
                            f"step {step + 1}: {skipped_in_row} steps in a row had a non-finite "
                            f"loss or gradient (train.max_skipped_steps = "
                            f"{c.train.max_skipped_steps}; last: "
                            f"{record['update/skip_reason']}); no update of theirs was applied. "
                            + (f"The last checkpoint, step {max(saved)}, is in "
                               f"{c.train.run_dir}." if saved else "No checkpoint was saved."))
                else:
                    skipped_in_row = 0
                bar.update(1)
                bar.set_postfix(reward=f"{record['reward/mean']:.3f}",
                                loss=f"{record['loss']:.4f}",
                                step_s=f"{record['time/train/step_s']:.1f}")
                done = step + 1
                if done % c.train.checkpoint_every == 0 or done == c.train.steps:
                    ckpt.save(done, self.state, self.opt_state)
            last = records[-1]["step"] if records else start
            if self.held_out and last == c.train.steps:
                if bar is not None:
                    bar.close()
                self._evaluate_into("after", last)
        except KeyboardInterrupt:  # keep what finished: a checkpoint at the last full step
            if records:
                ckpt.save(records[-1]["step"], self.state, self.opt_state)
            raise
        finally:
            if bar is not None:
                bar.close()
            run.close()
            ckpt.close()
        return records

    def _bookkeeping(self, record: dict[str, Any], step_times: list[float]) -> dict[str, Any]:
        """Time, throughput and memory figures of a step's record."""
        out = {"time/train/step_avg_last10_s": float(np.mean(step_times)),
               "throughput/tokens_per_s": record["tokens"] / record["time/train/step_s"],
               "memory/update_temp_bytes": self.update_temp_bytes,
               "memory/peak_rss_bytes": peak_rss_bytes()}
        device = device_peak_bytes()
        if device is not None:
            out["memory/device_peak_bytes"] = device
        out["memory/peak_bytes"] = device if device is not None else self.update_temp_bytes
        return out
