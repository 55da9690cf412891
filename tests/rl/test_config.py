"""TrainConfig: every bad key is named before any work starts."""

import glob
import os

import pytest
import yaml

from grpo_kernels.rl.config import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_defaults_and_round_trip():
    c = TrainConfig.from_dict({})
    assert c.loss.impl == "reference" and c.rollout.num_generations == 4
    assert TrainConfig.from_dict(c.to_dict()) == c
    lc = c.loss_config()
    assert lc.temperature == c.rollout.temperature
    assert lc.max_completion_length == c.rollout.max_new_tokens
    assert (lc.top_k, lc.top_p, lc.min_p) == (None, None, None)


def test_the_loss_takes_the_samplers_truncation_where_rows_are_whole():
    """rollout.top_k / top_p / min_p reach the loss (and so the log-prob passes) on one
    device and on a mesh that keeps vocabulary rows whole (a vocab axis of size 1 included);
    a vocab axis that splits the rows is a config error unless loss.truncation is off."""
    rollout = {"top_k": 20, "top_p": 0.9, "min_p": 0.05}
    lc = TrainConfig.from_dict({"rollout": rollout}).loss_config()
    assert (lc.top_k, lc.top_p, lc.min_p) == (20, 0.9, 0.05)
    for shape, vocab_axis in (({"dp": 2}, None), ({"dp": 2, "tp": 1}, "tp")):
        meshed = TrainConfig.from_dict({"rollout": rollout, "mesh": {
            "shape": shape, "vocab_axis": vocab_axis}})
        assert (meshed.loss_config().top_k, meshed.loss_config().top_p) == (20, 0.9)
    split = {"shape": {"dp": 1, "tp": 2}, "vocab_axis": "tp"}
    with pytest.raises(ValueError, match=r"mesh.vocab_axis.*loss.truncation: false"):
        TrainConfig.from_dict({"rollout": rollout, "mesh": split})
    whole = TrainConfig.from_dict({"rollout": rollout, "loss": {"truncation": False},
                                   "mesh": split})
    assert (whole.loss_config().top_k, whole.rollout.top_k) == (None, 20)


@pytest.mark.parametrize("values, key", [
    ({"trian": {}}, "trian"),
    ({"train": {"stpes": 3}}, "train.stpes"),
    ({"train": {"steps": "ten"}}, "train.steps"),
    ({"train": {"steps": 0}}, "train.steps"),
    ({"rollout": {"batch_size": 6, "num_generations": 4}}, "rollout.batch_size"),
    ({"rollout": {"num_generations": 1, "batch_size": 4}}, "rollout.num_generations"),
    ({"rollout": {"temperature": 0}}, "rollout.temperature"),
    ({"rollout": {"top_p": 1.5}}, "rollout.top_p"),
    ({"rollout": {"top_k": 0}}, "rollout.top_k"),
    ({"rollout": {"min_p": -0.5}}, "rollout.min_p"),
    ({"loss": {"truncation": "yes"}}, "loss.truncation"),
    ({"loss": {"options": {"top_k": 5}}}, "loss.options.top_k"),
    ({"rollout": {"batch_size": 8}, "train": {"micro_batch_size": 3}}, "train.micro_batch_size"),
    ({"loss": {"impl": "fast"}}, "loss.impl"),
    ({"loss": {"options": {"loss_type": "ppo"}}}, "loss.options"),
    ({"loss": {"options": {"temperature": 0.7}}}, "loss.options.temperature"),
    ({"loss": {"options": {"bogus": 1}}}, "loss.options"),
    ({"model": {"source": "gguf"}}, "model.path"),
    ({"model": {"source": "random", "tokenizer": "x"}}, "model.random"),
    ({"model": {"source": "hub"}}, "model.source"),
    ({"model": {"remat": "yes"}}, "model.remat"),
    ({"data": {"source": "gsm8k"}}, "data.path"),
    ({"data": {"difficulty": 4}}, "data.difficulty"),
    ({"rewards": {"functions": [{"name": "length"}]}}, "rewards.functions[0].name"),
    ({"rewards": {"functions": []}}, "rewards.functions"),
    ({"rewards": {"scale_rewards": "std"}}, "rewards.scale_rewards"),
    ({"optim": {"learning_rate": -1}}, "optim.learning_rate"),
    ({"optim": {"b2": 1.0}}, "optim.b2"),
    ({"logging": {"wandb_mode": "cloud"}}, "logging.wandb_mode"),
    ({"mesh": {"shape": {"dp": 2}, "vocab_axis": "tp"}}, "mesh"),
    ({"mesh": {"shape": {"dp": 3}}}, "train.micro_batch_size"),
    ({"loss": {"head": "lm"}}, "loss.head"),
    ({"loss": {"logits_dtype": "float16"}}, "loss.logits_dtype"),
    ({"train": {"keep_checkpoints": 0}}, "train.keep_checkpoints"),
    ({"model": {"param_dtype": "f16"}}, "model.param_dtype"),
    ({"model": {"source": "random", "tokenizer": "x", "random": {"hidden": 3}}},
     "model.random.hidden"),
    ({"model": {"source": "random", "tokenizer": "x",
                "random": {"num_heads": 4, "num_kv_heads": 3}}}, "model.random.num_kv_heads"),
    ({"model": {"source": "random", "tokenizer": "x", "random": {"family": "gpt2"}}},
     "model.random.family"),
    ({"rewards": {"functions": [{"name": "format"}, {"name": "x"}]}},
     "rewards.functions[1].name"),
    ({"loss": {"options": {"loss_agg_mode": "token-mean"}}}, "loss.options.loss_agg_mode"),
    ({"loss": {"kernel": {"logits-reference": {}}}}, "loss.kernel.logits-reference"),
    ({"loss": {"kernel": {"logits-auto": {}}}}, "loss.kernel.logits-auto"),
    ({"loss": {"kernel": {"logits-pallas": 3}}}, "loss.kernel.logits-pallas"),
    ({"loss": {"kernel": {"logits-pallas": {"gpu_layuot": "aligned"}}}},
     "loss.kernel.logits-pallas.gpu_layuot"),
    ({"loss": {"kernel": {"logits-pallas": {"alias_logits": "yes"}}}},
     "loss.kernel.logits-pallas.alias_logits"),
    ({"loss": {"kernel": {"logits-pallas": {"gpu_layout": "diagonal"}}}},
     "loss.kernel.logits-pallas: PallasOptions.gpu_layout"),
    ({"loss": {"kernel": {"logits-pallas": {"blocks": {"block_rows": 8}}}}},
     "loss.kernel.logits-pallas: PallasBlockSizes.block_rows"),
    ({"loss": {"kernel": {"logits-xla": {"chunk_bytes": 0}}}},
     "loss.kernel.logits-xla: XlaBlockSizes.chunk_bytes"),
    ({"loss": {"kernel": {"fused-xla": {"dweight": "rows"}}}},
     "loss.kernel.fused-xla: LmHeadBlockSizes.dweight"),
    ({"loss": {"kernel": {"fused-pallas": {"interpret": "tpu"}}}},
     "loss.kernel.fused-pallas: LmHeadPallasOptions.interpret"),
])
def test_bad_values_name_the_key(values, key):
    with pytest.raises(ValueError) as e:
        TrainConfig.from_dict(values)
    assert str(e.value).startswith(key), str(e.value)


def test_old_loss_impl_spelling_names_the_new_keys():
    with pytest.raises(ValueError, match="loss.impl: 'lm_head_fused' is now two keys: "
                                         "loss.head: fused and loss.impl: xla"):
        TrainConfig.from_dict({"loss": {"impl": "lm_head_fused"}})


def test_sections_validate_on_construction():
    from grpo_kernels.rl.config import LossSection, RandomModelSection, RolloutSection

    with pytest.raises(ValueError, match="rollout.batch_size: 3 is not divisible"):
        RolloutSection(batch_size=3)
    with pytest.raises(ValueError, match="model.random.head_dim"):
        RandomModelSection(head_dim=0)
    assert LossSection(head="fused", impl="auto").arm == "fused-auto"


def test_dtype_spellings():
    c = TrainConfig.from_dict({"model": {"param_dtype": "bf16", "compute_dtype": "f32"}})
    assert (c.model.param_dtype, c.model.compute_dtype) == ("bf16", "f32")


def test_replace_validates_again():
    c = TrainConfig.from_dict({})
    assert c.replace(**{"train.steps": 7}).train.steps == 7
    with pytest.raises(ValueError, match="rollout.batch_size"):
        c.replace(**{"rollout.batch_size": 7})


TRAINING_CONFIGS = sorted([*(p for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml"))
                             if os.path.basename(p) != "gradcheck.yaml"),
                           os.path.join(ROOT, "src", "grpo_kernels", "proof", "gpu_ab.yaml")])


def test_training_configs_are_shipped():
    names = {os.path.basename(p) for p in TRAINING_CONFIGS}
    assert {"default.yaml", "smollm2_gsm8k.yaml", "qwen2.5_1.5b_gsm8k.yaml"} <= names


@pytest.mark.parametrize("path", TRAINING_CONFIGS, ids=os.path.basename)
def test_shipped_configs_validate(path):
    with open(path, encoding="utf-8") as f:
        TrainConfig.from_dict(yaml.safe_load(f))
