"""The cases of tests/sharding/test_multiprocess.py, shared with its worker processes."""

from __future__ import annotations

import jax.numpy as jnp

from grpo_kernels.config import CLASSIC_LOSS_TYPES
from grpo_kernels.ops.lm_head_loss.inputs import random_head_inputs
from grpo_kernels.ops.logits_loss.inputs import random_inputs

B, T, V = 4, 6, 64            # logits op: 16 columns per device at tp=4
# LM-head op (B as above): T = 8 divides by tp=4, so the xla head runs sequence-parallel across
# the processes (hidden split over T); T = 5 keeps hidden whole (which one: :func:`factors`).
HTS, HH, HV = (8, 5), 32, 256

# Each loss type once (VESPO with the token-level sampler correction it needs, CISPO with a
# cap that acts). The other factors of a case follow the bits a, b, d of its index: a
# fractional factorial of 8 runs in which every pair of levels of any two factors occurs
# twice. The level is a; the mesh's axis types b (Explicit when set, the logits then split
# over the batch only); the head's H split over dp too (FSDP weights) d; beta a ^ b; the
# head's T (8: divides by tp = 4, the xla head runs sequence-parallel across the processes;
# 5 keeps the hidden states whole) a ^ d. What crossing processes adds is the collectives,
# and those follow the level, the mesh and the head's split, not the loss type (each loss
# type's own terms are per row; tests/sharding/test_sharding.py meets the classic loss types
# with both levels and every mesh in one process).
LOSS_TYPES = (*CLASSIC_LOSS_TYPES, "cispo", "sapo", "vespo", "luspo")
_EXTRA = {"cispo": {"epsilon_high": 1.05}, "vespo": {
    "sampler_correction": "token_truncate", "sampler_correction_max": 1.05}}


def factors(i: int) -> dict:
    """Case ``i``'s factors from the bits a, b, d of ``i``: ``level`` (a), ``beta`` (a ^ b),
    ``explicit`` (the mesh's axis types, b), ``fsdp`` (the head's H over dp too, d) and
    ``head_time`` (the head's T, a ^ d)."""
    a, b, d = i & 1, i >> 1 & 1, i >> 2 & 1
    return {"level": ("token", "sequence")[a], "beta": (0.0, 0.04)[a ^ b],
            "explicit": bool(b), "fsdp": bool(d), "head_time": HTS[a ^ d]}


CASES = [dict(loss_type=lt, importance_sampling_level=factors(i)["level"],
              beta=factors(i)["beta"], max_completion_length=T + 2, **_EXTRA.get(lt, {}))
         for i, lt in enumerate(LOSS_TYPES)]


def logits_inputs(i, cfg):
    return random_inputs(100 + i, B, T, V, jnp.float32, cfg, noise=0.3)


def head_inputs(i, cfg):
    return random_head_inputs(200 + i, B, factors(i)["head_time"], HH, HV, jnp.float32, cfg)


# The trainer case: one update of the test trainer's small random model on a fixed batch of
# 8 rows (two micro-batches of 4, one row per device of the dp axis), beta on (so the
# reference log-probs come back from the mesh too), both heads. Adam's eps = 1 makes the step
# about lr * g, so parameters after it compare like gradients; with a small eps each weight
# moves by about lr * sign(g), and a gradient near zero (most of a tied head's rows) flips
# with float32 rounding. The large rate keeps the moves far above the float32 spacing of the
# weights (~1e-9 at 0.01): at lr = 0.1 a move of 3e-7 is only known to 3e-3.
TRAINER_HEADS = ("logits", "fused")


def trainer_values(run_dir, head):
    from tests.rl.test_trainer import _values

    # float32 compute, so that both sides agree to float32 rounding rather than bfloat16's
    return _values(run_dir, train={"steps": 1, "micro_batch_size": 4},
                   model={"compute_dtype": "float32"},
                   rollout={"batch_size": 8, "num_generations": 2},
                   loss={"head": head, "impl": "xla"},
                   optim={"learning_rate": 100.0, "eps": 1.0, "warmup_steps": 0},
                   rewards={"functions": [{"name": "correctness"}]})  # no rollout is scored


def trainer_batch(trainer, prompt=4, completion=6):
    """A rollout-shaped :class:`~grpo_kernels.rl.policy.Batch` from a fixed seed: left-padded
    prompts, completions that end early, group-varying advantages."""
    import numpy as np

    from grpo_kernels.rl.policy import Batch

    rng = np.random.default_rng(7)
    rows, vocab = trainer.config.rollout.batch_size, trainer.model.config.vocab_size
    ids = rng.integers(0, vocab, (rows, prompt + completion), dtype=np.int32)
    attention = np.ones_like(ids)
    attention[::3, :2] = 0  # left padding
    lengths = rng.integers(2, completion + 1, rows)
    mask = (np.arange(completion)[None, :] < lengths[:, None]).astype(np.int32)
    attention[:, prompt:] = mask
    return Batch(ids=ids, attention=attention, mask=mask,
                 advantages=rng.normal(size=rows).astype(np.float32), prompt_width=prompt)


def trainer_updates(out: str, process_id: int, num_processes: int, heads=TRAINER_HEADS) -> None:
    """One :meth:`Trainer.update` on the fixed batch of :func:`trainer_batch` for each head,
    in a process of a ``jax.distributed`` run, on a ``(tp=2, dp=4)`` mesh whose vocabulary
    axis spans the processes. Process 0 writes the parameters after each step and the
    update's metrics into ``OUT.<head>.npz``."""
    import jax
    import numpy as np

    from grpo_kernels.rl.config import TrainConfig
    from grpo_kernels.rl.processes import to_host
    from grpo_kernels.rl.trainer import Trainer

    for head in heads:
        values = trainer_values(f"{out}.{head}.run{process_id}", head)
        # (tp=2, dp=4) over the global device list: tp's two rows are the two processes'
        values["mesh"] = {"shape": {"tp": 2, "dp": 4}, "batch_axes": ["dp"], "vocab_axis": "tp"}
        trainer = Trainer(TrainConfig.from_dict(values), progress=False)
        assert {d.process_index for d in trainer.mesh.devices[:, 0]} == set(range(num_processes))
        metrics = trainer.update(trainer_batch(trainer))
        leaves = {f"param_{i}": to_host(x) for i, x in enumerate(jax.tree.leaves(trainer.state))}
        if process_id == 0:
            np.savez(f"{out}.{head}.npz", **leaves,
                     **{f"metric_{k}": np.float64(v) for k, v in metrics.items()})
        print(f"process {process_id}: {head} update done, loss {metrics['loss']:.6g}",
              flush=True)
