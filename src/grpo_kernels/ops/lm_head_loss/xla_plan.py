"""How the fused XLA head cuts its work: :class:`LmHeadBlockSizes` (the user's options) and the
per-platform plans of the token chunks, the vocabulary blocks and the ``dW`` row blocks
(docs/lm_head.md has the measurements behind each default)."""

from __future__ import annotations

import dataclasses

from grpo_kernels.ops.core.options import check_int


@dataclasses.dataclass(frozen=True)
class LmHeadBlockSizes:
    """Chunking of the fused LM-head loop.

    Attributes:
      chunk_tokens: Rows (tokens) per chunk; ``None`` derives it from ``chunk_bytes``.
      chunk_bytes: Target size of one chunk's vocabulary-sized work arrays (float32 logits plus
        the logits-dtype gradient); ``None`` picks a backend default.
      dweight: How the weight gradient is summed over tokens. ``"tokens"`` (default, the
        faster): in the token pass, into an ``[H, V]`` float32 accumulator (three matmuls of
        the logits' size per step). ``"vocab"`` (the smaller): in a second pass over blocks of
        vocabulary columns, every token at once
        (:func:`~grpo_kernels.ops.lm_head_loss.xla_vocab.vocab_sweep`): no accumulator, four
        matmuls. Worth it when ``4 H V`` bytes are a large share of the step's memory, e.g. a
        wide head over a few thousand tokens; docs/lm_head.md has the measured trade.
    """

    chunk_tokens: int | None = None
    chunk_bytes: int | None = None
    dweight: str = "tokens"

    def __post_init__(self) -> None:
        for name in ("chunk_tokens", "chunk_bytes"):
            check_int("LmHeadBlockSizes", name, getattr(self, name))
        if self.dweight not in DWEIGHT_MODES:
            raise ValueError(f"LmHeadBlockSizes.dweight must be one of {DWEIGHT_MODES}, "
                             f"got {self.dweight!r}")


DWEIGHT_MODES: tuple[str, ...] = ("tokens", "vocab")


# Byte budget of one chunk's [c, V] float32 logits. CPU and GPU: the measured choices of
# docs/lm_head.md and docs/benchmarks.md. On GPU, 1 GiB rounded down to a power of two (1,024
# rows at V = 151,936): against 2,048 rows, a training step's peak 0.91x for 1.04x its time
# on an H100, which brings the step under half the materialised reference's peak. TPU (compile
# plans on a v6e, no TPU run): of 32 MiB to 1 GiB, 1 GiB has the lowest roofline time for a
# tunix iteration at 8,192 tokens (each halving re-reads the head twice as often: 1.4-1.9x
# the time at 512 MiB, 2.3-2.9x at 256 MiB), for 1.1-3.9x the temporaries of 256 MiB;
# docs/integrations/tunix.md has the table.
DEFAULT_CHUNK_BYTES = {"cpu": 32 << 20, "gpu": 1 << 30, "tpu": 1 << 30}
# Backends whose planned rows are rounded down to a power of two, so that power-of-two token
# counts split into equal chunks with no separately compiled tail.
_POW2_CHUNKS = frozenset({"gpu"})


def plan_chunk(n_rows: int, vocab: int, blocks: LmHeadBlockSizes, backend: str) -> int:
    """Rows per chunk: the byte budget over a row's float32 logits, a multiple of 8 (a power
    of two on GPU).

    A row costs ``4 V`` bytes of float32 logits (plus its narrower gradient); the ``[c, H]``
    buffers are small beside them and do not enter. docs/lm_head.md records how the CPU
    default was chosen (time and temporaries against neighbouring chunk sizes).
    """
    if blocks.chunk_tokens is not None:
        return min(blocks.chunk_tokens, n_rows)
    budget = blocks.chunk_bytes or DEFAULT_CHUNK_BYTES.get(backend, 256 << 20)
    rows = max(8, budget // (4 * vocab) // 8 * 8)
    if backend in _POW2_CHUNKS:
        rows = max(8, 1 << (rows.bit_length() - 1))
    return min(rows, n_rows)


def plan_vocab_block(n_rows: int, vocab: int, blocks: LmHeadBlockSizes, backend: str) -> int:
    """Vocabulary columns per block of :func:`vocab_sweep`: an eighth of the chunk's byte
    budget over a column's ``N`` float32 logits, a multiple of 128, at least 128.

    The eighth because a block keeps several ``[N, cols]`` arrays live (logits, their
    exponent, ``delta``); with the whole budget per array the pass planned more than the
    accumulator it replaces (N = 512, H = 1024, V = 32768 on XLA:CPU).
    """
    budget = blocks.chunk_bytes or DEFAULT_CHUNK_BYTES.get(backend, 256 << 20)
    return min(vocab, max(128, budget // (32 * n_rows) // 128 * 128))


# float32 elements of one dW update product [rows, V] on CPU (docs/lm_head.md says why).
DWEIGHT_ELEMENTS = 1 << 22
# Rows of one dW update on TPU: a multiple of the MXU's 128 and 256 (docs/lm_head.md).
TPU_DWEIGHT_ROWS = 512


def dweight_rows(hidden: int, vocab: int, kind: str) -> int:
    """Rows of ``dW [H, V]`` per update on a ``kind`` (``cpu``, ``gpu``, ``tpu``) platform.

    CPU: :data:`DWEIGHT_ELEMENTS` over ``V``, a multiple of 8, at most ``H``. A vocabulary
    shard passes the global ``V`` (its product shrinks with it). GPU: all ``H`` rows, one
    ``[H, c] x [c, V]`` product per chunk. Row blocks of a few dozen rows are skinny matmuls
    that each re-read the whole ``delta``; on an H100 they made the fused op slower than the
    materialised reference (docs/benchmarks.md, "How the GPU kernels' layout and tiling were
    chosen"). TPU: :data:`TPU_DWEIGHT_ROWS`, at most ``H``: with all rows XLA:TPU kept a whole
    ``[H, V]`` float32 product beside the accumulator and copied ``W`` twice to relayout it
    (6.7 GB of temporaries at H = 4096, V = 151,936 against 3.6 GB in 512-row blocks; the time
    on a TPU is not measured).
    """
    if kind == "tpu":
        return min(hidden, TPU_DWEIGHT_ROWS)
    if kind != "cpu":
        return hidden
    return min(hidden, max(8, DWEIGHT_ELEMENTS // vocab // 8 * 8))
