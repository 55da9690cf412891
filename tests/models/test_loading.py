"""models.loading: a model and tokenizer from a config's model fields; errors name the key."""

import jax.numpy as jnp
import pytest

from grpo_kernels.models.loading import load_policy, load_tokenizer
from tests.rl.test_trainer import _tokenizer_path

SHAPE = {"family": "llama", "hidden_size": 32, "intermediate_size": 64, "num_layers": 3,
         "num_heads": 4, "num_kv_heads": 2, "head_dim": 8}


def test_random_model_from_shape_and_cut_layers():
    model, tok = load_policy("random", tokenizer=_tokenizer_path(), random=SHAPE,
                             param_dtype="bf16", num_layers=2, seed=1)
    assert model.config.num_layers == 2 and len(model.layers) == 2
    assert model.config.vocab_size == tok.tokenizer.get_vocab_size()
    assert jnp.dtype(model.config.param_dtype) == jnp.bfloat16


@pytest.mark.parametrize("kwargs,match", [
    (dict(source="gguf", path="/nonexistent.gguf"), "model.path '/nonexistent.gguf': no such file"),
    (dict(source="hf", path="/nonexistent"), "model.path '/nonexistent': no such directory"),
    (dict(source="hub"), "model.source must be one of"),
    (dict(source="random", random={**SHAPE, "rope_scaling": {"rope_type": "bogus"}}),
     "model.random: rope_scaling"),
    (dict(source="random", random=SHAPE, param_dtype="f16"), "dtype must be one of"),
])
def test_errors_name_the_key(kwargs, match):
    kwargs.setdefault("tokenizer", _tokenizer_path())
    with pytest.raises(ValueError, match=match):
        load_policy(**kwargs)


def test_missing_tokenizer_names_the_key():
    with pytest.raises(ValueError, match="model.tokenizer '/nope': no such file or directory"):
        load_tokenizer("/nope")
