"""examples/tunix_grpo.py: the weight copy into tunix's Llama3, the step-1 comparison, and its
argument errors. (The run itself, tunix's GRPOLearner for 5 steps per loss, takes minutes: its
figures are in docs/integrations/tunix.md with the command.)"""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("tunix", reason="google-tunix is not installed (make test installs "
                    "grpo-kernels[tunix])")

from tunix.models.llama3 import model as llama3  # noqa: E402

from grpo_kernels.models.config import ModelConfig  # noqa: E402
from grpo_kernels.models.decoder import Decoder  # noqa: E402

_PATH = pathlib.Path(__file__).parents[2] / "examples" / "tunix_grpo.py"
_spec = importlib.util.spec_from_file_location("tunix_grpo_example", _PATH)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tunix_llama3_copy_gives_the_same_logits(monkeypatch, tied):
    """A random 2-layer Llama-family Decoder and its tunix copy: same logits (float32), with a
    rope_theta other than tunix's built-in 1e6, which the example binds."""
    monkeypatch.setattr(llama3, "apply_rope", llama3.apply_rope)  # restored after the test
    config = ModelConfig(family="llama", vocab_size=97, hidden_size=32, intermediate_size=48,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         rope_theta=10_000.0, tie_word_embeddings=tied,
                         compute_dtype=jnp.float32)
    decoder = Decoder(config, nnx.Rngs(3))
    for layer in decoder.layers:  # non-trivial norm scales, so a swapped norm would show
        layer.input_norm.weight.set_value(1 + 0.1 * jax.random.normal(jax.random.PRNGKey(1),
                                                                      (32,)))
    model = example.tunix_llama3(config, decoder)
    ids = np.random.default_rng(0).integers(0, 97, (2, 11))
    assert example.copy_error(decoder, model, ids) <= 1e-5
    # without the bound theta, tunix's Llama3 would rotate at 1e6 and differ
    monkeypatch.setattr(llama3, "apply_rope", llama3.apply_rope.func)
    assert example.copy_error(decoder, model, ids) > 1e-4


def test_copy_refuses_other_families():
    config = ModelConfig(family="qwen2", vocab_size=97, hidden_size=32, intermediate_size=48,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                         attention_bias=True)
    with pytest.raises(ValueError, match="needs a Llama-family model"):
        example.tunix_llama3(config, Decoder(config, nnx.Rngs(0)))


def test_compare_flags_a_disagreement():
    ref, old = np.linspace(-3.0, -0.1, 6).reshape(2, 3), np.linspace(-2.0, -0.2, 6).reshape(2, 3)

    def run(name, loss, norm, logps=(ref, old)):
        return {"loss_fn": name, "wall_s": 1.0, "peak_rss_bytes_so_far": 1,
                "step1_logps": dict(zip(("reference_logps", "old_logps"), logps)),
                "steps": [{"step": 0, "rewards/train/mean": 0.1},
                          {"step": 1, "actor/train/loss": loss, "actor/train/grad_norm": norm}]}

    same = example.compare([run("grpo", 0.5, 2.0), run("grpo_kernels_fused", 0.5 + 1e-6, 2.0,
                                                       (ref + 1e-6, old))])
    assert same["agree"] and same["loss"]["abs_diff"] == pytest.approx(1e-6)
    assert same["reference_logps"]["max_rel_diff"] == pytest.approx(1e-6 / 3)
    assert not example.compare([run("grpo", 0.5, 2.0),
                                run("grpo_kernels_fused", 0.5, 2.1)])["agree"]
    off = example.compare([run("grpo", 0.5, 2.0),
                           run("grpo_kernels_fused", 0.5, 2.0, (ref, old + 1e-3))])
    assert not off["agree"] and not off["old_logps"]["agree"] and off["reference_logps"]["agree"]
    missing = example.compare([run("grpo", 0.5, 2.0), {**run("grpo_kernels_fused", 0, 0),
                                                       "steps": []}])
    assert not missing["agree"]
    no_passes = example.compare([run("grpo", 0.5, 2.0), run("grpo_kernels_fused", 0.5, 2.0, ())])
    assert not no_passes["agree"]


def test_a_finished_run_records_nothing_more(tmp_path):
    """tunix keeps every run's metrics backend registered as a jax.monitoring listener, so a
    second run's values reached the first run's recorder and the comparison compared the
    second run with itself. A stopped recorder ignores them."""
    first, second = (example._Recorder(str(tmp_path / f"{n}.jsonl")) for n in ("a", "b"))
    for r in (first, second):
        jax.monitoring.register_scalar_listener(r.log_scalar)
    try:
        jax.monitoring.record_scalar("actor/train/loss", 1.0, step=1)
        first.stop()
        jax.monitoring.record_scalar("actor/train/loss", 2.0, step=1)
    finally:
        jax.monitoring.clear_event_listeners()
    assert first.rows == {1: {"step": 1, "actor/train/loss": 1.0}}
    assert second.rows == {1: {"step": 1, "actor/train/loss": 2.0}}
    assert (tmp_path / "a.jsonl").read_text().count("\n") == 1


@pytest.mark.parametrize("argv,match", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--num-generations", "1"], "--num-generations must be >= 2"),
    (["--gguf", "/nonexistent.gguf"], "no such file"),
])
def test_bad_arguments_name_the_flag(tmp_path, capsys, argv, match):
    with pytest.raises(SystemExit):
        example.main([*argv, "--out", str(tmp_path)])
    assert match in capsys.readouterr().err
