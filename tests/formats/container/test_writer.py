"""Streaming writer: byte identity with the safetensors library, ordering, atomicity."""

import hashlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from h3quant.errors import ContainerError
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.container.writer import Entry, StreamingWriter, plan_layout, save_tensors


def _mixed():
    g = torch.Generator().manual_seed(0)
    return {
        "blocks.0.mlp.fc1.weight": torch.randint(-128, 128, (8, 16), generator=g, dtype=torch.int8),
        "blocks.0.mlp.fc1.weight_scale": torch.rand(8, 1, generator=g),
        "blocks.0.mlp.fc1.comfy_quant": torch.tensor(list(b'{"format": "int8_tensorwise"}'), dtype=torch.uint8),
        "norm.weight": torch.randn(16, generator=g).bfloat16(),
        "half": torch.randn(3, 5, generator=g).half(),
        "rope.inv_freq": torch.rand(16, generator=g),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "f8": torch.randn(7, generator=g).to(torch.float8_e4m3fn),
        "i64": torch.arange(3),
        "flag": torch.tensor([True, False, True]),
    }


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_bytes_equal_safetensors_library(tmp_path, metadata):
    tensors = _mixed()
    out = tmp_path / "a.safetensors"
    save_tensors(out, tensors, metadata)
    assert out.read_bytes() == st_save(tensors, metadata=metadata)


def test_metadata_sorted_and_readable(tmp_path):
    out = tmp_path / "m.safetensors"
    save_tensors(out, {"x": torch.ones(2)}, {"zz": "1", "aa": "2"})
    with safe_open(str(out), "pt") as f:
        assert f.metadata() == {"zz": "1", "aa": "2"}
    raw = out.read_bytes()
    assert raw.index(b'"aa"') < raw.index(b'"zz"')


def test_golden_sha(tmp_path):
    out = tmp_path / "g.safetensors"
    save_tensors(out, {"a": torch.arange(4, dtype=torch.int8), "b": torch.ones(2, dtype=torch.float32)},
                 {"k": "v"})
    expected = st_save({"a": torch.arange(4, dtype=torch.int8), "b": torch.ones(2)}, metadata={"k": "v"})
    assert hashlib.sha256(out.read_bytes()).hexdigest() == hashlib.sha256(expected).hexdigest()
    n = int.from_bytes(out.read_bytes()[:8], "little")
    assert n % 8 == 0


@pytest.mark.parametrize("mmap", [True, False])
def test_round_trip_through_reader(tmp_path, mmap):
    tensors = _mixed()
    out = tmp_path / "r.safetensors"
    save_tensors(out, tensors)
    with Checkpoint(out, mmap=mmap) as ck:
        assert set(ck.tensors) == set(tensors)
        for name, t in tensors.items():
            got = ck.read(name)
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_streaming_in_chunks(tmp_path):
    layout = plan_layout([Entry("b", "F32", (4,)), Entry("a", "I8", (6,))])
    out = tmp_path / "c.safetensors"
    with StreamingWriter(out, layout) as w:
        w.write("b", torch.arange(2, dtype=torch.float32).numpy().tobytes())
        w.write("b", torch.arange(2, 4, dtype=torch.float32).numpy().tobytes())
        w.write("a", bytes(range(6)))
    with Checkpoint(out) as ck:
        assert ck.read("b").tolist() == [0.0, 1.0, 2.0, 3.0]
        assert ck.read("a").tolist() == list(range(6))


def test_out_of_order_write_rejected_and_nothing_left(tmp_path):
    layout = plan_layout([Entry("b", "F32", (4,)), Entry("a", "I8", (6,))])
    out = tmp_path / "o.safetensors"
    with pytest.raises(ContainerError, match="expected b"):
        with StreamingWriter(out, layout) as w:
            w.write("a", bytes(6))
    assert list(tmp_path.iterdir()) == []


def test_incomplete_output_is_not_renamed(tmp_path):
    layout = plan_layout([Entry("a", "I8", (6,))])
    out = tmp_path / "i.safetensors"
    with pytest.raises(ContainerError, match="incomplete"):
        with StreamingWriter(out, layout) as w:
            w.write("a", bytes(3))
    assert list(tmp_path.iterdir()) == []


def test_too_many_bytes_rejected(tmp_path):
    layout = plan_layout([Entry("a", "I8", (2,))])
    with pytest.raises(ContainerError, match="header says 2"):
        with StreamingWriter(tmp_path / "x.safetensors", layout) as w:
            w.write("a", bytes(3))
    assert list(tmp_path.iterdir()) == []


def test_exception_keeps_existing_target(tmp_path):
    out = tmp_path / "keep.safetensors"
    out.write_bytes(b"original")
    layout = plan_layout([Entry("a", "I8", (2,))])
    with pytest.raises(RuntimeError):
        with StreamingWriter(out, layout):
            raise RuntimeError("boom")
    assert out.read_bytes() == b"original"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.safetensors"]


def test_duplicate_names_rejected():
    with pytest.raises(ContainerError, match="duplicate"):
        plan_layout([Entry("a", "I8", (2,)), Entry("a", "F32", (1,))])


def test_wrong_tensor_shape_rejected(tmp_path):
    layout = plan_layout([Entry("a", "F32", (2,))])
    with pytest.raises(ContainerError, match="planned F32"):
        with StreamingWriter(tmp_path / "w.safetensors", layout) as w:
            w.write_tensor("a", torch.ones(3))


def test_output_mode_follows_umask(tmp_path):
    import os

    old = os.umask(0o022)
    try:
        out = tmp_path / "p.safetensors"
        save_tensors(out, {"a": torch.ones(1)})
        assert out.stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(old)
