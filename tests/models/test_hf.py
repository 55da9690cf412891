"""The decoder against Hugging Face transformers on tiny random checkpoints made here."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (dev extra) makes the reference checkpoints")
transformers = pytest.importorskip("transformers", reason="transformers (dev extra) is the "
                                   "reference implementation")

from grpo_kernels.models import ModelConfig, load_hf_checkpoint  # noqa: E402

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def make_checkpoint(tmp_path, family, tie=False, shard=False, rope_scaling=None, seed=0):
    torch.manual_seed(seed)
    if family == "qwen2":
        cfg = transformers.Qwen2Config(**SMALL, tie_word_embeddings=tie)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        extra = {"rope_scaling": rope_scaling} if rope_scaling else {}
        cfg = transformers.LlamaConfig(**SMALL, tie_word_embeddings=tie, **extra)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # random, non-trivial norms and biases (init leaves them 1 and 0)
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.eval()
    path = str(tmp_path / f"{family}-{tie}-{shard}")
    model.save_pretrained(path, max_shard_size="20KB" if shard else "2GB")
    return path, model


def hf_logits(model, ids, mask=None):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(np.asarray(ids)),
                    attention_mask=None if mask is None else torch.tensor(np.asarray(mask)))
    return out.logits.float().numpy()


IDS = np.random.default_rng(0).integers(0, 97, size=(2, 11))


@pytest.mark.parametrize("family,tie,shard", [("qwen2", False, False), ("qwen2", True, True),
                                              ("llama", False, True), ("llama", True, False)])
def test_logits_equal_transformers(tmp_path, family, tie, shard):
    path, ref = make_checkpoint(tmp_path, family, tie, shard)
    if shard:
        assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    config, model = load_hf_checkpoint(path, compute_dtype=jnp.float32)
    assert config.family == family and config.tie_word_embeddings == tie
    got = np.asarray(model(jnp.asarray(IDS)))
    want = hf_logits(ref, IDS)
    assert np.max(np.abs(got - want)) <= 1e-4, np.max(np.abs(got - want))


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8}])
def test_rope_scaling_equals_transformers(tmp_path, scaling):
    path, ref = make_checkpoint(tmp_path, "llama", rope_scaling=scaling)
    config, model = load_hf_checkpoint(path, compute_dtype=jnp.float32)
    assert config.rope_type == scaling["rope_type"]
    got = np.asarray(model(jnp.asarray(IDS)))
    assert np.max(np.abs(got - hf_logits(ref, IDS))) <= 1e-4


def test_left_padding_and_hidden_states(tmp_path):
    path, ref = make_checkpoint(tmp_path, "qwen2")
    _, model = load_hf_checkpoint(path, compute_dtype=jnp.float32)
    mask = np.ones_like(IDS)
    mask[0, :4] = 0  # row 0 left-padded
    got = np.asarray(model(jnp.asarray(IDS), jnp.asarray(mask)))
    want = hf_logits(ref, IDS, mask)
    assert np.max(np.abs(got[0, 4:] - want[0, 4:])) <= 1e-4
    assert np.max(np.abs(got[1] - want[1])) <= 1e-4
    hidden = model(jnp.asarray(IDS), return_hidden=True)
    logits = jnp.einsum("bth,vh->btv", hidden, model.head())
    np.testing.assert_allclose(np.asarray(logits), np.asarray(model(jnp.asarray(IDS))),
                               atol=1e-5)


def test_bf16_compute_is_close(tmp_path):
    path, ref = make_checkpoint(tmp_path, "llama")
    _, model = load_hf_checkpoint(path)  # f32 params, bf16 compute (the default)
    got = np.asarray(model(jnp.asarray(IDS)))
    want = hf_logits(ref, IDS)
    assert np.max(np.abs(got - want)) <= 0.05 * np.max(np.abs(want))


def test_config_spellings_of_transformers_4_and_5():
    v4 = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8,
              intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
              rope_theta=5e5, torch_dtype="bfloat16",
              rope_scaling={"rope_type": "linear", "factor": 4.0})
    v5 = {k: v for k, v in v4.items() if k not in ("rope_theta", "torch_dtype", "rope_scaling")}
    v5.update(dtype="bfloat16", rope_parameters={"rope_theta": 5e5, "rope_type": "linear",
                                                 "factor": 4.0})
    a, b = ModelConfig.from_hf(v4), ModelConfig.from_hf(v5)
    assert a == b and a.rope_theta == 5e5 and a.rope_type == "linear" and a.num_kv_heads == 2


def test_bad_checkpoints_name_the_file_and_tensor(tmp_path):
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        load_hf_checkpoint(str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_hf_checkpoint(str(empty))
    (empty / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unknown architecture"):
        load_hf_checkpoint(str(empty))
    path, _ = make_checkpoint(tmp_path, "qwen2")
    cfg = json.loads(open(os.path.join(path, "config.json")).read())
    cfg["intermediate_size"] = 128
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj"
                       r".weight' has shape \(96, 64\), config.json implies \(128, 64\)"):
        load_hf_checkpoint(path)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_hf_checkpoint(path)
