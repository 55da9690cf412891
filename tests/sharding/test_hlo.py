"""The HLO collective reader on hand-written lines (no devices needed, but lives with its users)."""

from grpo_kernels.sharding.hlo import collectives, summary

TEXT = """
  %all-reduce.1 = f32[2,6]{1,0} all-reduce(f32[2,6]{1,0} %x), channel_id=1, to_apply=%add
  %ar.2 = (f32[], bf16[32,256]{1,0}) all-reduce(f32[] %a, bf16[32,256]{1,0} %b), to_apply=%add
  %ag = bf16[8,128]{1,0} all-gather(bf16[2,128]{1,0} %y), dimensions={0}
  %ags = (bf16[2,128]{1,0}, bf16[8,128]{1,0}) all-gather-start(bf16[2,128]{1,0} %y)
  %agd = bf16[8,128]{1,0} all-gather-done((bf16[2,128]{1,0}, bf16[8,128]{1,0}) %ags)
  %add.3 = f32[2,6]{1,0} add(f32[2,6]{1,0} %p, f32[2,6]{1,0} %q)
"""


def test_collectives_are_read_with_their_result_shapes():
    found = collectives(TEXT)
    assert [c.op for c in found] == ["all-reduce", "all-reduce", "all-gather", "all-gather"]
    assert found[0].arrays == (("f32", (2, 6)),) and found[0].bytes == 48
    assert found[1].bytes == 4 + 32 * 256 * 2 and found[1].elements == 32 * 256
    assert found[3].arrays == (("bf16", (8, 128)),)  # the start's result, not its operand
    s = summary(TEXT)
    assert s["all-reduce"] == 48 + 4 + 16384 and s["all-gather"] == 2 * 8 * 128 * 2
    assert s["total"] == s["all-reduce"] + s["all-gather"] and s["largest_elements"] == 8192
