"""grpo_kernels.proof.gpu_layouts's arguments: bad ones are named, before any kernel runs."""

import pytest

from grpo_kernels.proof import gpu_layouts


def test_lists_parse():
    assert gpu_layouts.shape_list("2048x151643,8x300") == [(2048, 151643), (8, 300)]
    assert gpu_layouts.tiling_list("4096x4,16384x8") == [(4096, 4), (16384, 8)]
    assert gpu_layouts.tiling_list("") == []
    blocks = gpu_layouts.pallas_gpu_one_pass.OnePassBlocks
    planned = gpu_layouts.pallas_gpu_one_pass.plan_blocks(1, 1).stages
    assert gpu_layouts.one_pass_list("16384x16x132,8192x8x264x1,8192x8x264x2x0") == [
        blocks(16384, 16, 132, planned), blocks(8192, 8, 264, 1),
        blocks(8192, 8, 264, 2, l2_hints=False)]
    assert blocks(8192, 8, 264, 2).l2_hints  # the planner's hints are on
    names = [gpu_layouts.one_pass_name(b) for b in gpu_layouts.one_pass_list(
        "8192x8x264x2x1,8192x8x264x2x0")]
    assert names == ["one_pass_8192x8x264x2", "one_pass_8192x8x264x2_no_l2_hints"]


@pytest.mark.parametrize("argv,match", [
    (["--shapes", "2048"], "--shapes wants N x V pairs"),
    (["--shapes", "0x300"], "--shapes wants N x V pairs"),
    (["--tilings", "4000x4"], "--tilings wants vocabulary tile x warps pairs"),
    (["--tilings", "4096x3"], "--tilings wants vocabulary tile x warps pairs"),
    (["--tilings", "4096"], "--tilings wants vocabulary tile x warps pairs"),
    (["--iters", "0"], "--iters and --rounds must be >= 1"),
    (["--tilings", "256x4", "--block-vocab", "128"], "the sweeps take --tilings or"),
    (["--one-pass-tilings", "8192x8"], "--one-pass-tilings wants tile x warps x programs"),
    (["--one-pass-tilings", "8192x64x132"], "--one-pass-tilings wants tile x warps x programs"),
    (["--one-pass-tilings", "8192x8x0"], "--one-pass-tilings wants tile x warps x programs"),
    (["--one-pass-tilings", "8192x8x132x0"], "--one-pass-tilings wants tile x warps x"),
    (["--one-pass-tilings", "8192x8x132x5"], "[x 1 to 4 [x 0 or 1]]"),
    (["--one-pass-tilings", "8192x8x132x2x2"], "--one-pass-tilings wants tile x warps x"),
    (["--one-pass-tilings", "8192x8x132x2x1x1"], "--one-pass-tilings wants tile x warps x"),
    (["--one-pass-tilings", "256x4x3", "--block-vocab", "128"], "the sweeps take --tilings or"),
    (["--one-pass-tilings", "256x4x3", "--tilings", "256x4"], "two sweeps: give one"),
], ids=["no-x", "zero-rows", "tile-not-pow2", "odd-warps", "no-warps", "iters", "both",
        "one-pass-pair", "one-pass-warps", "one-pass-programs", "one-pass-no-stages",
        "one-pass-stages", "one-pass-hints", "one-pass-six", "one-pass-block-vocab",
        "two-sweeps"])
def test_bad_arguments_name_the_flag(capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        gpu_layouts.main(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err
