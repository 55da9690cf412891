"""TextTokenizer against transformers' tokenizer on the Qwen2.5 files in ../shared, and SmolLM2."""

import os

import pytest

from grpo_kernels.models.tokenizer import TextTokenizer

QWEN = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data",
                    "qwen2.5-tokenizer")

MESSAGES = [{"role": "system", "content": "You are a careful math tutor."},
            {"role": "user", "content": "What is 17 * 24? Answer with digits, like 1,234."}]
TEXTS = ["Hello world", "  leading spaces and\ttabs\n\nnewlines", "数学 и кириллица 🙂",
         "<|im_start|>user\nhi<|im_end|>", "1234567 + 89 = 1234656"]


@pytest.fixture(scope="module")
def qwen():
    if not os.path.isfile(os.path.join(QWEN, "tokenizer.json")):
        pytest.skip(f"no Qwen2.5 tokenizer at {QWEN} (the shared test data)")
    return TextTokenizer.from_dir(QWEN)


def test_qwen_matches_transformers(qwen):
    transformers = pytest.importorskip("transformers", reason="transformers (dev extra) is the "
                                       "reference tokenizer")
    ref = transformers.AutoTokenizer.from_pretrained(QWEN)
    for text in TEXTS:
        ids = qwen.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert qwen.decode(ids, skip_special_tokens=False) == text
    want = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert qwen.apply_chat_template(MESSAGES) == want
    assert qwen.eos_ids == [151643, 151645] and qwen.pad_id == 151643


def test_bad_input(qwen, tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        TextTokenizer.from_dir(str(tmp_path))
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict with 'role'"):
        qwen.apply_chat_template([{"content": "x"}])
    with pytest.raises(ValueError, match="not in the vocabulary"):
        qwen.token_id("<|no such token|>")


def test_smollm2_chat_template_from_gguf():
    from grpo_kernels.models.gguf_loader import smollm2_path

    try:
        path = smollm2_path()
    except ValueError as e:
        pytest.skip(f"{e} (make test installs it)")
    tok = TextTokenizer.from_gguf(path)
    prompt = tok.apply_chat_template(MESSAGES[1:])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" or 2 in tok.eos_ids
    ids = tok.encode(prompt)
    assert tok.decode(ids, skip_special_tokens=False) == prompt
