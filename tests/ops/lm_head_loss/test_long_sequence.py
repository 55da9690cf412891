"""The fused op's planned temporaries do not grow with the sequence (compile-only, nothing is
allocated; about 3 s per shape): benchmarks/long_sequence.py records the table in
docs/lm_head.md."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

from long_sequence import planned_temp  # noqa: E402


@pytest.mark.default_emitters
def test_fused_temporaries_do_not_grow_with_t():
    """Qwen's head (H=4096, V=151,936, bf16): T=8,192 against T=131,072. The temporaries are
    the chunk's logits and the float32 weight-gradient accumulator, independent of T, plus a
    few float32 vectors per token; any [T, H] or [T, V] buffer would add 8 KiB or more per
    token (1 GiB at this T). At V=32,768 XLA:CPU does keep a uint16 copy of the hidden states
    (docs/lm_head.md, "Long sequences"), so this shape is the one the claim is made for."""
    short, long = (planned_temp(t, 4096, 151936) for t in (8192, 131072))
    assert long <= 1.01 * short, (short, long)
    assert (long - short) / (131072 - 8192) < 64  # bytes per token
