"""``TextTokenizer``: a ``tokenizers`` tokenizer with its chat template and special token ids.

From a Hugging Face tokenizer directory (``tokenizer.json`` plus ``tokenizer_config.json``, whose
``chat_template`` is rendered with jinja2 in a sandbox) or from a GGUF file's metadata.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<|endoftext|>", ...} in older configs
        return value.get("content")
    return value


class TextTokenizer:
    """Encode, decode and chat-format text for one model.

    Args:
      tokenizer: A ``tokenizers.Tokenizer``.
      chat_template: A jinja2 chat template (the Hugging Face convention: ``messages``,
        ``add_generation_prompt``, ``bos_token``, ``eos_token``), or None.
      eos_token, bos_token, pad_token: Special token strings (None when absent).
      source: Where it came from, for error messages.
    """

    def __init__(self, tokenizer: Any, chat_template: str | None = None,
                 eos_token: str | None = None, bos_token: str | None = None,
                 pad_token: str | None = None, source: str = "tokenizer"):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.source = source
        self.eos_token, self.bos_token, self.pad_token = eos_token, bos_token, pad_token
        for name in ("eos_token", "bos_token", "pad_token"):
            token = getattr(self, name)
            if token is not None and tokenizer.token_to_id(token) is None:
                raise ValueError(f"{source}: {name} {token!r} is not in the vocabulary")

    # --- construction ------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str) -> "TextTokenizer":
        """From ``tokenizer.json`` and (optionally) ``tokenizer_config.json`` in ``path``."""
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise ValueError(f"{path}: no tokenizer.json")
        tok = Tokenizer.from_file(file)
        config: dict[str, Any] = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            with open(cfg_file, encoding="utf-8") as f:
                try:
                    config = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{cfg_file}: not valid JSON: {e}") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"),
                            None)
        return cls(tok, template, _token_text(config.get("eos_token")),
                   _token_text(config.get("bos_token")), _token_text(config.get("pad_token")),
                   source=path)

    @classmethod
    def from_gguf(cls, path: str) -> "TextTokenizer":
        """From a GGUF file's ``tokenizer.*`` metadata."""
        from grpo_kernels.models.gguf_loader import gguf_metadata, tokenizer_from_gguf

        tok = tokenizer_from_gguf(path)
        tokens = gguf_metadata(path, "tokenizer.ggml.tokens")

        def special(key):
            idx = gguf_metadata(path, f"tokenizer.ggml.{key}_token_id")
            return None if idx is None else tokens[int(idx)]

        return cls(tok, gguf_metadata(path, "tokenizer.chat_template"), special("eos"),
                   special("bos"), special("padding"), source=path)

    # --- use ---------------------------------------------------------------------------------

    def token_id(self, token: str) -> int:
        idx = self.tokenizer.token_to_id(token)
        if idx is None:
            raise ValueError(f"{self.source}: token {token!r} is not in the vocabulary")
        return idx

    @property
    def eos_ids(self) -> list[int]:
        """Ids that end a completion: the EOS token and, for chat models, ``<|im_end|>``."""
        ids = [] if self.eos_token is None else [self.token_id(self.eos_token)]
        im_end = self.tokenizer.token_to_id("<|im_end|>")
        if im_end is not None and im_end not in ids:
            ids.append(im_end)
        return ids

    @property
    def pad_id(self) -> int:
        """The padding id (the pad token, else the EOS token, else 0)."""
        token = self.pad_token or self.eos_token
        return 0 if token is None else self.token_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens written in it are recognised; no BOS added)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (``[{"role": ..., "content": ...}]``)."""
        if not self.chat_template:
            raise ValueError(f"{self.source}: no chat_template")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', "
                                 f"got {m!r}")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")
