"""grpo_kernels.models.gguf_file: the header read as the ``gguf`` package's own reader reads it."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package reads and writes GGUF files")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from grpo_kernels.models.gguf_file import GGUFFile  # noqa: E402


def _write(path, alignment=None):
    """A file with a value of every metadata type, arrays of numbers, strings and booleans,
    and float32, float16 and Q8_0 tensors (fresh random values); the float tensors."""
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), arch="llama")
    if alignment:
        w.add_uint32("general.alignment", alignment)
    for kind, value in (("uint8", 200), ("int8", -100), ("uint16", 60000), ("int16", -30000),
                        ("uint32", 4_000_000_000), ("int32", -2_000_000_000),
                        ("uint64", 2**60 + 3), ("int64", -(2**60)), ("float32", 0.1),
                        ("float64", 1e-300), ("bool", True), ("string", "héllo ⁂")):
        getattr(w, f"add_{kind}")(f"t.{kind}", value)
    w.add_array("t.ints", rng.integers(-50, 50, 1000).tolist())
    w.add_array("t.floats", rng.normal(size=7).tolist())
    w.add_array("t.strings", ["", "a b", "Ġthe", "日本"] * 50)
    w.add_array("t.bools", [True, False, True])
    floats = {"f32": rng.normal(size=(3, 5)).astype(np.float32),
              "f16": rng.normal(size=(7,)).astype(np.float16)}
    for name, x in floats.items():
        w.add_tensor(name, x)
    q8 = rng.normal(size=(2, 64)).astype(np.float32)
    w.add_tensor("q8", quantize(q8, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return floats


@pytest.mark.parametrize("alignment", [None, 64])
def test_fields_and_tensors_equal_the_gguf_packages_reader(tmp_path, alignment):
    path = tmp_path / "all.gguf"
    floats = _write(path, alignment)
    ours, theirs = GGUFFile(str(path)), gguf.GGUFReader(str(path))
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # its header, as fields
    assert sorted(ours.fields) == sorted(keys)
    for key in keys:
        want = theirs.fields[key].contents()
        assert ours.fields[key] == want and type(ours.fields[key]) is type(want), key
    assert ours.fields["t.string"] == "héllo ⁂" and ours.fields["t.bools"] == [True, False, True]
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.shape == tuple(int(d) for d in reversed(t.shape.tolist())), t.name
        assert mine.tensor_type == t.tensor_type, t.name
        np.testing.assert_array_equal(mine.data, np.asarray(t.data).reshape(-1).view(np.uint8))
        np.testing.assert_array_equal(
            gguf.quants.dequantize(mine.data, mine.tensor_type).reshape(-1),
            gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1))
    for name, x in floats.items():  # the values written, at the offsets the alignment gives
        np.testing.assert_array_equal(ours.tensors[name].data.view(x.dtype).reshape(x.shape), x)


def test_bad_files_name_the_file_and_the_problem(tmp_path):
    good = tmp_path / "good.gguf"
    _write(good)
    raw = good.read_bytes()
    cases = {"magic": (b"GGML" + raw[4:], "no 'GGUF' magic"),
             "version": (raw[:4] + (1).to_bytes(4, "little") + raw[8:], "version 1 is not"),
             "big-endian": (raw[:4] + (3).to_bytes(4, "big") + raw[8:], "big-endian"),
             "cut header": (raw[:200], "runs past the end"),
             "cut data": (raw[:-100], "tensor 'q8'"),
             "not UTF-8": (raw.replace("héllo".encode(), b"h\xffllo "), "is not UTF-8")}
    for name, (data, match) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(ValueError, match=match) as e:
            GGUFFile(str(path))
        assert str(path) in str(e.value), name
