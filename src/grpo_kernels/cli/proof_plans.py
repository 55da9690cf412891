"""The proof's plans: which phase groups run, at which shapes (``--plan``, ``--dry-run``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Plan:
    """Shapes and lists of one proof run."""

    name: str
    logits_shapes: tuple[tuple[int, int], ...] = ((1, 2048), (4, 1024))
    vocab: int = 151643
    # The GPU layouts' A/B (proof/gpu_layouts.py): N x V; 151,936 is Qwen's padded
    # vocabulary, whose rows are 16-byte aligned in either layout.
    layout_shapes: tuple[tuple[int, int], ...] = (
        (2048, 151643), (4096, 151643), (2048, 151936))
    layout_block_vocab: int | None = None
    # The aligned layout's tiling sweep (block_vocab, num_warps), at layout_shapes, last of
    # all phases (the one to lose when time runs out). 4096 leaves a tail of under 100 columns
    # at V = 151,643, where the planner's 8192 leaves about 4,200.
    layout_tilings: tuple[tuple[int, int], ...] = ((4096, 4), (8192, 8), (16384, 8))
    # The one-pass GPU kernel's sweep (block_vocab, num_warps, persistent programs, load
    # stages[, L2 hints 0/1]) beside its planner's 16384 x 16 x 132 x 2 with hints; 132 is an
    # H100 SXM's multiprocessors. Against the planner's: no loads ahead, or two; half tiles;
    # two programs per multiprocessor (8192 x 8 at one stage, 128 registers: two fit) in place
    # of loads ahead; 8192 x 8 with loads ahead (182 registers, one program per
    # multiprocessor); the planner's without its L2 eviction hints.
    one_pass_tilings: tuple[tuple[int, ...], ...] = (
        (16384, 16, 132, 1), (16384, 16, 132, 3), (8192, 16, 132, 2), (8192, 8, 264, 1),
        (8192, 8, 132, 2), (16384, 16, 132, 2, 0))
    groups: tuple[str, ...] = ("env", "logits", "lm_head", "liger")
    head: tuple[int, int, int, int] = (1, 8192, 4096, 151936)  # B, T, H, V
    family: tuple[int, int, int] = (2, 256, 32773)  # B, T, V: four full tiles and a tail
    family_levels: str = "token,sequence"  # the levels the family's gradcheck runs at
    copy_rows: int = 4096
    gradcheck_impls: tuple[str, ...] = ("pallas", "xla")
    memory_impls: tuple[str, ...] = ("reference", "xla", "pallas")
    iters: int = 20
    head_iters: int = 10
    # The step plan. The trainer's update (proof/gpu_train_step.py) and tunix's
    # (gpu_tunix_step.py): model shape, layers kept, rows x (prompt + completion), the arms.
    step_model: str = "qwen2.5-1.5b"
    step_layers: int = 4
    step_batch: tuple[int, int, int] = (8, 256, 1024)
    step_iters: int = 5
    train_arms: tuple[str, ...] = ("logits-reference", "logits-xla", "logits-pallas",
                                   "fused-xla", "fused-xla-chunk2048", "fused-xla-vocab",
                                   "fused-pallas")
    tunix_arms: tuple[str, ...] = ("tunix", "fused-xla", "logps-tunix", "logps-ours")
    # The same program on tunix's development head (``--tunix-head``): (arm, the head's
    # chunk size for tunix's own arms, 0 for unchunked or ours).
    tunix_head_arms: tuple[tuple[str, int], ...] = ()
    # The trainer's A/B (proof/gpu_ab.yaml): steps per arm and --set overrides.
    ab_steps: int = 3
    ab_sets: tuple[str, ...] = ()
    # The fused head beside Liger at ``head``: our variants (liger_peer.py
    # --head-variants: dweight mode @ chunk rows), and those whose device peak is measured
    # (dweight, chunk rows or None for the planner's): each compiled in one process, then
    # loaded from the compile cache and run in another, whose peak is the step's alone.
    head_variants: str = "xla-tokens,xla-vocab,xla-tokens@2048,xla-vocab@2048"
    head_memory: tuple[tuple[str, int | None], ...] = (
        ("tokens", None), ("vocab", None), ("tokens", 2048))


GROUPS = ("env", "layouts", "logits", "lm_head", "liger")
# The step plan's groups: the trainer's update per arm, tunix's update, the fused head beside
# Liger (both dweight modes, Liger eager and compiled), the trainer's A/B.
STEP_GROUPS = ("env", "train", "head", "tunix", "ab")
REAL = Plan("real")
# A rerun that skips what an earlier run of the same code measured (xla gradcheck, reference memory).
SHORT = dataclasses.replace(REAL, name="short", gradcheck_impls=("pallas",),
                            memory_impls=("pallas", "xla"))
# The GPU kernel designs against each other, and the sweeps (docs/benchmarks.md has its time).
LAYOUTS = dataclasses.replace(REAL, name="layouts", groups=("env", "layouts"))
# Every phase at tiny shapes, on whatever backend is there (CI runs it on the CPU).
DRY = Plan("dry", logits_shapes=((1, 8), (2, 5)), vocab=300,
           layout_shapes=((16, 300), (8, 256)), layout_block_vocab=128,
           layout_tilings=((256, 4),), one_pass_tilings=((128, 4, 3, 1), (128, 4, 3, 3, 0)),
           head=(1, 16, 32, 300), family=(2, 6, 300), family_levels="sequence", copy_rows=16,
           iters=2, head_iters=2,
           groups=GROUPS)
# A training step, not an op: the update of each loss arm, tunix's update, the fused head
# beside Liger, and a short trainer A/B (under 8 minutes on an H100 is the aim).
STEP = dataclasses.replace(REAL, name="step", groups=STEP_GROUPS)
# The step plan's phases at tiny shapes (CI runs it on the CPU).
DRY_STEP = dataclasses.replace(
    DRY, name="dry-step", groups=STEP_GROUPS, step_model="tiny", step_layers=2,
    step_batch=(2, 8, 16), step_iters=2, ab_steps=2,
    head_variants="xla-tokens,xla-vocab@8", head_memory=(("tokens", None), ("vocab", 8)),
    ab_sets=("model.random.hidden_size=64", "model.random.intermediate_size=128",
             "model.random.num_layers=1", "model.random.num_heads=4",
             "model.random.num_kv_heads=2", "model.random.head_dim=16",
             "model.random.vocab_size=null", "rollout.batch_size=4", "rollout.num_generations=2",
             "rollout.max_new_tokens=6", "train.micro_batch_size=4"))
# tunix's development head at the step plan's shape: its update and log-prob pass unchunked
# and with its own chunking at 256 positions, against ours with the adapter's defaults.
# The model without its head (no-head) is the floor under both; fused-xla-tokens the adapter's
# faster dweight mode.
TUNIX_HEAD_ARMS = (("tunix", 0), ("tunix", 256), ("fused-xla", 0), ("fused-xla-tokens", 0),
                   ("no-head", 0), ("logps-tunix", 0), ("logps-tunix", 256), ("logps-ours", 0),
                   ("logps-no-head", 0))
TUNIX = dataclasses.replace(STEP, name="tunix", groups=("env", "tunix"), tunix_arms=(),
                            tunix_head_arms=TUNIX_HEAD_ARMS)
DRY_TUNIX = dataclasses.replace(
    DRY_STEP, name="dry-tunix", groups=("env", "tunix"), tunix_arms=(),
    tunix_head_arms=tuple((arm, 8 if chunk else 0) for arm, chunk in TUNIX_HEAD_ARMS))
PLANS = {p.name: p for p in (REAL, SHORT, LAYOUTS, STEP, TUNIX, DRY)}
# --dry-run --plan NAME: the plan's tiny twin (DRY for every plan without one).
DRY_PLANS = {"step": DRY_STEP, "tunix": DRY_TUNIX}


def plan_of(name: str, dry_run: bool) -> Plan:
    """The plan ``--plan name`` (``--dry-run``: its tiny twin) runs."""
    return DRY_PLANS.get(name, DRY) if dry_run or name == "dry" else PLANS[name]
