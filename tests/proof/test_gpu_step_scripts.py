"""The step plan's programs, before anything runs: their micro-batch, their arguments, and the
fused-head variants of the Liger peer (the proof's dry run runs them, tests/cli/test_proof.py)."""

import numpy as np
import pytest

from grpo_kernels import LmHeadBlockSizes
from grpo_kernels.proof import device_memory, gpu_train_step, gpu_tunix_step, liger_peer


def test_the_micro_batch_is_a_trainer_batch_drawn_from_the_seed():
    mb = gpu_train_step.micro_batch(3, rows=6, prompt=10, completion=12, vocab=50)
    again = gpu_train_step.micro_batch(3, rows=6, prompt=10, completion=12, vocab=50)
    assert all(np.array_equal(mb[k], again[k]) for k in ("ids", "mask", "ref_logps"))
    ids, att, mask = mb["ids"], mb["attention"], mb["mask"]
    assert ids.shape == att.shape == (6, 22) and mask.shape == (6, 12)
    for r in range(6):
        prompt = att[r, :10]
        start = int(np.argmax(prompt))
        assert prompt[start:].all() and not prompt[:start].any()  # left-padded
        assert 5 <= prompt.sum() <= 10 and (ids[r, :start] == 0).all()
        n = int(mask[r].sum())
        assert 6 <= n <= 12 and mask[r, :n].all() and np.array_equal(att[r, 10:], mask[r])
    assert (ids[att == 1] >= 1).all() and (ids < 50).all()
    assert mb["old_logps"] is None and mb["sampler_logps"] is None
    assert np.all(np.abs(mb["ref_logps"] + np.log(50)) < 1.0)  # near a random model's
    other = gpu_train_step.micro_batch(4, rows=6, prompt=10, completion=12, vocab=50)
    assert not np.array_equal(mb["ids"], other["ids"])


@pytest.mark.parametrize("script, argv, message", [
    (gpu_train_step, ["--arm", "fused-xla", "--rows", "0"], "--rows must be at least 1"),
    (gpu_train_step, ["--arm", "fused-xla", "--layers", "29"],
     "--layers must be in [1, 28] for qwen2.5-1.5b"),
    (gpu_train_step, ["--arm", "fused-triton"], "argument --arm: invalid choice"),
    (gpu_train_step, ["--arm", "logits-xla", "--warmup", "-1"], "--warmup must be at least 0"),
    (gpu_tunix_step, ["--arm", "grpo"], "argument --arm: invalid choice"),
    (gpu_tunix_step, ["--arm", "tunix", "--model", "tiny", "--layers", "3"],
     "--layers must be in [1, 2] for tiny"),
    (gpu_tunix_step, ["--arm", "tunix", "--iters", "0"], "--iters must be at least 1"),
    (gpu_tunix_step, ["--arm", "fused-xla", "--chunk-size", "8"],
     "--chunk-size is tunix's option: arm 'fused-xla' is ours"),
    (gpu_tunix_step, ["--arm", "tunix", "--chunk-size", "-1"], "--chunk-size must be at least 0"),
    (gpu_tunix_step, ["--arm", "tunix", "--tunix-path", "/nonexistent"],
     "--tunix-path '/nonexistent' holds no tunix package"),
    (device_memory, ["--op", "logits", "--impl", "xla", "--batch", "1", "--time", "2",
                     "--vocab", "8", "--dweight", "vocab"], "--dweight and --chunk-tokens are "
     "options of --op lm_head --impl xla"),
    (device_memory, ["--op", "lm_head", "--impl", "xla", "--batch", "1", "--time", "2",
                     "--vocab", "8", "--hidden", "4", "--chunk-tokens", "0"],
     "LmHeadBlockSizes.chunk_tokens"),
])
def test_bad_arguments_name_the_flag(capsys, script, argv, message):
    with pytest.raises(SystemExit) as e:
        (script.main if script is device_memory else script.parse_args)(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_tunix_arms_agree_on_the_installed_tunix(capsys):
    """tunix's update unchunked and chunked (the development head only; 0.1.7 refuses the
    chunk with a reason), ours, and the no-head floor, on the tiny model: one first loss for
    the losses, one mean log-prob for the passes. Run against the head by make test-tunix-head."""
    import jax

    # tunix's own losses mix bool and int32 arrays (tests/integrations/conftest.py)
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        _tunix_arms_agree(capsys)


def _tunix_arms_agree(capsys):
    import json

    small = ["--model", "tiny", "--layers", "1", "--rows", "2", "--prompt", "4",
             "--completion", "8", "--iters", "1", "--warmup", "0"]
    head = gpu_tunix_step.tunix_version() == "head"
    if not head:
        assert gpu_tunix_step.main(["--arm", "tunix", "--chunk-size", "4", *small]) == 2
        assert "needs tunix's development head" in capsys.readouterr().err
    arms = [("tunix", 0), ("fused-xla", 0), ("no-head", 0), ("logps-tunix", 0),
            ("logps-ours", 0)] + ([("tunix", 4), ("logps-tunix", 4)] if head else [])
    rows = {}
    for arm, chunk in arms:
        assert gpu_tunix_step.main(["--arm", arm, "--chunk-size", str(chunk), *small]) == 0
        rows[arm, chunk] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    base, logps = rows["tunix", 0], rows["logps-tunix", 0]
    assert {r["tunix"] for r in rows.values()} == {"head" if head else "0.1.7"}
    for key, r in rows.items():
        if key[0] in ("tunix", "fused-xla"):
            assert r["loss"] == pytest.approx(base["loss"], rel=1e-5, abs=1e-5), key
            assert r["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-2), key
        elif key[0].startswith("logps-"):
            assert r["mean_logp"] == pytest.approx(logps["mean_logp"], rel=1e-5), key
    floor = rows["no-head", 0]
    assert np.isfinite(floor["loss"]) and abs(floor["loss"]) < abs(base["loss"])


def test_every_train_arm_names_a_trainer_arm_and_its_options():
    from grpo_kernels.rl.kernel import resolve

    for arm, (head, impl, entry) in gpu_train_step.ARMS.items():
        assert arm.startswith(f"{head}-{impl}")
        if arm != "fused-pallas":  # TPU kernels: resolved on a TPU only
            _, options = resolve(head, impl, {} if entry is None else {f"{head}-{impl}": entry})
            if entry:
                assert all(getattr(options, k) == v for k, v in entry.items())


def test_head_variants_parse_to_the_options():
    assert liger_peer.head_variants("xla,xla-vocab@1024, xla-tokens") == [
        ("xla", ("xla", None)),
        ("xla-vocab@1024", ("xla", LmHeadBlockSizes(chunk_tokens=1024, dweight="vocab"))),
        ("xla-tokens", ("xla", LmHeadBlockSizes(dweight="tokens")))]
    for bad in ("pallas", "xla-vocab@", "xla@x", "xla-rows"):
        with pytest.raises(ValueError, match="--head-variants"):
            liger_peer.head_variants(bad)


@pytest.mark.parametrize("argv, message", [
    (["--op", "lm_head", "--head-variants", "xla-rows"], "--head-variants: 'xla-rows'"),
    (["--op", "lm_head", "--liger-modes", "eager,jit"], "--liger-modes: expected eager"),
    (["--op", "logits", "--device", "cpu"], "--device cpu: only --op lm_head"),
])
def test_the_peer_names_a_bad_flag_before_any_work(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        liger_peer.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
