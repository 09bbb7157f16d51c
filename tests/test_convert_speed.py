"""convert's I/O levers: kernel-side copies of byte-for-byte tensors, with a fallback through
memory that gives the same bytes (also when the kernel refuses part way through)."""

from __future__ import annotations

import errno
import os

import pytest

from h3quant.pipelines.convert import ConvertOptions, compute, convert
from h3quant.pipelines.convert.io import OffsetWriter
from tests.test_convert import sha, small_h3, write


@pytest.fixture
def src(tmp_path):
    return write(tmp_path / "in.safetensors", small_h3(blocks=1))


def _convert(src, dst, **kw):
    convert(src, dst, ConvertOptions(report=False, **kw))
    return sha(dst)


@pytest.fixture
def kernel_copy(monkeypatch):
    monkeypatch.setattr(compute, "_kernel_copy", [True])


def test_copied_tensors_go_through_the_kernel_and_match_the_memory_path(src, tmp_path, monkeypatch,
                                                                       kernel_copy):
    if not hasattr(os, "copy_file_range"):
        pytest.skip("no os.copy_file_range here")
    calls = []
    real = OffsetWriter.copy_range
    monkeypatch.setattr(OffsetWriter, "copy_range",
                        lambda self, *a: calls.append(a[0]) or real(self, *a))
    kernel = _convert(src, tmp_path / "k.safetensors")
    assert calls and "adaln_t_table" in calls  # the byte-for-byte tensors took the kernel path
    monkeypatch.setattr(compute, "_kernel_copy", [False])
    calls.clear()
    memory = _convert(src, tmp_path / "m.safetensors")
    assert not calls
    assert kernel == memory


@pytest.mark.parametrize("err", [errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP])
def test_a_kernel_that_refuses_part_way_falls_back_with_the_same_bytes(src, tmp_path, monkeypatch,
                                                                      kernel_copy, err):
    reference = _convert(src, tmp_path / "ref.safetensors", workers=1)
    budget = [3]

    def flaky(src_fd, dst_fd, count, offset_src, offset_dst):
        if budget[0] == 0:
            raise OSError(err, os.strerror(err))
        budget[0] -= 1
        n = max(1, count // 3)  # partial copies: the fallback resumes mid-tensor
        data = os.pread(src_fd, n, offset_src)
        return os.pwrite(dst_fd, data, offset_dst)

    monkeypatch.setattr(os, "copy_file_range", flaky, raising=False)
    assert _convert(src, tmp_path / "flaky.safetensors", workers=1) == reference
    assert compute._kernel_copy == [False]


def test_a_real_io_error_in_the_kernel_copy_fails_the_run(src, tmp_path, monkeypatch, kernel_copy):
    def broken(*a):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "copy_file_range", broken, raising=False)
    with pytest.raises(Exception) as info:
        convert(src, tmp_path / "out.safetensors", ConvertOptions(report=False))
    assert "I/O error" in str(info.value) or isinstance(info.value, OSError)
    assert not (tmp_path / "out.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name != "in.safetensors"]
