"""Options and tiling of the Pallas LM-head kernels (:mod:`.pallas_tpu`)."""

from __future__ import annotations

import dataclasses

from grpo_kernels.ops.core.options import check_int, check_interpret, resolved_interpret
from grpo_kernels.ops.core.tpu import MiB, VMEM_BYTES, check_generation, scoped_vmem_limit
from grpo_kernels.ops.core.tpu import tpu_generation
from grpo_kernels.ops.core.validate import backend_kind


@dataclasses.dataclass(frozen=True)
class LmHeadPallasBlockSizes:
    """Tiling of the Pallas LM-head kernels (TPU tiling rules, checked on construction).

    Attributes:
      block_rows: Rows per grid step ``tm`` (multiple of 16); ``None``: 256, or fewer for
        small ``N``.
      block_vocab: Vocabulary tile ``tv`` (multiple of 128); ``None``: 512, or 128 on a chip
        with 16 MiB of VMEM (v4), where the ``dW`` kernel's ``[H, tv]`` blocks at 512 do not
        fit (a deviceless compile at H = 4096 needed 26.5 MiB).
      block_hidden: ``H`` tile ``tk`` of the statistics kernel (a divisor of ``H``, multiple of
        128, or ``H``); ``None``: the largest of 2048, 1024, 512 that divides ``H``, else ``H``.
    """

    block_rows: int | None = None
    block_vocab: int | None = None
    block_hidden: int | None = None

    def __post_init__(self) -> None:
        for name, mult in (("block_rows", 16), ("block_vocab", 128), ("block_hidden", 128)):
            check_int("LmHeadPallasBlockSizes", name, getattr(self, name), multiple=mult,
                      why=" (TPU tiling)")


@dataclasses.dataclass(frozen=True)
class LmHeadPallasOptions:
    """Options of ``impl="pallas"`` for the fused head.

    Attributes:
      blocks: The kernels' tiling; ``None``: the defaults of :class:`LmHeadPallasBlockSizes`.
      vmem_limit_bytes: Scoped VMEM limit of the kernels; ``None``: 64 MiB, or the chip's
        VMEM where that is less.
      tpu_generation: The TPU the tiles are planned for (as
        :class:`~grpo_kernels.ops.logits_loss.pallas.PallasOptions`); ``None``: the first
        device's, else ``"v6e"``.
      interpret: Interpret mode; ``None``: exactly when the backend is CPU; ``"hlo"``: JAX's
        generic HLO interpreter (what :mod:`grpo_kernels.sharding` uses on a CPU mesh).
      match_tpu_layout: Run the kernels on ``W`` (each device's shard, under
        :mod:`grpo_kernels.sharding`) in the orientation in which a TPU stores a jit argument
        of its shape (:func:`~grpo_kernels.ops.core.tpu.row_major_by_default`): a ``[H, V]``
        head whose ``V`` is not a multiple of 128 is kept ``H``-minor, so the kernels take
        ``W^T`` as a ``"vh"`` head. A parameter in its default layout is then read and its
        gradient written without a relayout (the Mosaic kernels need their operands
        row-major; otherwise XLA copies ``W`` in and ``dW`` out). ``False``: the given
        orientation, for a ``W`` pinned row-major (``jax.experimental.layout``).
    """

    blocks: LmHeadPallasBlockSizes | None = None
    vmem_limit_bytes: int | None = None
    interpret: bool | str | None = None
    tpu_generation: str | None = None
    match_tpu_layout: bool = True

    def __post_init__(self) -> None:
        check_interpret("LmHeadPallasOptions", self.interpret)
        if not isinstance(self.match_tpu_layout, bool):
            raise ValueError(f"LmHeadPallasOptions.match_tpu_layout must be a bool, got "
                             f"{self.match_tpu_layout!r}")
        check_generation("LmHeadPallasOptions.tpu_generation", self.tpu_generation)
        check_int("LmHeadPallasOptions", "vmem_limit_bytes", self.vmem_limit_bytes)
        if self.blocks is not None and not isinstance(self.blocks, LmHeadPallasBlockSizes):
            raise ValueError(f"LmHeadPallasOptions.blocks must be None or an "
                             f"LmHeadPallasBlockSizes, got {type(self.blocks).__name__}")

    def resolved_interpret(self, backend: str | None = None) -> bool | str:
        return resolved_interpret(self.interpret, backend_kind(backend))

    def check_backend(self, interpret: bool | str | None = None) -> None:
        """ValueError where compiled kernels would run on a GPU (``interpret``: the mode that
        runs, default the options'). The kernels are Mosaic (TPU) only and would fail deep in
        Triton's lowering; a named ``tpu_generation`` says the caller traces here for a TPU
        (``jax.export``), which stays allowed."""
        interpret = self.resolved_interpret() if interpret is None else interpret
        if not interpret and backend_kind() == "gpu" and self.tpu_generation is None:
            raise ValueError("impl='pallas' of the fused head has TPU kernels only; on a GPU "
                             "use impl='xla' (or 'auto'), or LmHeadPallasOptions(interpret="
                             "True)")


@dataclasses.dataclass(frozen=True)
class Tiles:
    rows: int
    vocab: int
    hidden: int
    vmem_limit_bytes: int


def plan_tiles(n: int, hidden: int, vocab: int, opts: LmHeadPallasOptions) -> Tiles:
    """Tile sizes for ``N`` rows, hidden size ``H`` and vocabulary ``V`` (see the options)."""
    blocks = opts.blocks or LmHeadPallasBlockSizes()
    gen = tpu_generation(opts.tpu_generation)
    rows = blocks.block_rows or min(256, -(-n // 16) * 16)
    tv = blocks.block_vocab or min(512 if VMEM_BYTES[gen] >= 64 * MiB else 128,
                                   -(-vocab // 128) * 128)
    tk = blocks.block_hidden
    if tk is None:
        tk = next((c for c in (2048, 1024, 512) if hidden % c == 0 and c < hidden), hidden)
    if hidden % tk:
        raise ValueError(f"LmHeadPallasBlockSizes.block_hidden={tk} must divide H={hidden}")
    return Tiles(rows, tv, tk, opts.vmem_limit_bytes or scoped_vmem_limit(gen, 64 * MiB))
