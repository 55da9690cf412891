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
