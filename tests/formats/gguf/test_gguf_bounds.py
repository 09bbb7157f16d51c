"""GGUF headers are walked by h3quant, in bounded time and memory, before the gguf package
reads them: every count and length against the bytes left in the file and ``h3quant.limits``.
The hostile files are tiny (at most 9 MB), written byte by byte (``h3quant.testing.hostile_gguf``)."""

from __future__ import annotations

import struct

import pytest
from hostile_util import h3q_measured

from h3quant.errors import ContainerError
from h3quant.formats.gguf import GgufFile
from h3quant.formats.gguf.header import check_header
from h3quant.limits import MAX_GGUF_METADATA_VALUES
from h3quant.testing.hostile_gguf import (ARCH, ARRAY, STRING, U8, array, field, gguf_bytes,
                                          hostile_ggufs, tensor, write_hostile)

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def bombs(tmp_path_factory):
    return write_hostile(tmp_path_factory.mktemp("hostile-gguf"))


@pytest.mark.parametrize("name", list(hostile_ggufs()))
def test_every_hostile_header_is_refused_in_process(bombs, name):
    with pytest.raises(ContainerError, match="malformed GGUF header") as e:
        GgufFile(bombs[name])
    assert str(bombs[name]) in str(e.value)


@pytest.mark.parametrize("name", ["array 2^60", "1e6 strings", "array 5e6 u8", "string 2^62"])
@pytest.mark.parametrize("cmd", ["inspect", "validate", "convert"])
def test_bombs_answered_fast_and_small_by_every_command(bombs, tmp_path, name, cmd):
    args = [cmd, bombs[name]] + ([tmp_path / "o.safetensors", "--to", "bf16"]
                                 if cmd == "convert" else [])
    code, text, cpu_secs, peak = h3q_measured(*args, timeout=60)
    assert code in (1, 2), text
    assert "malformed GGUF header" in text and "Traceback" not in text, text
    assert cpu_secs < 10 and peak < 500, (cpu_secs, peak)
    assert not (tmp_path / "o.safetensors").exists()


def test_a_header_at_the_limit_is_read(tmp_path):
    """The rule, not the case: a header just inside the budget passes; one more element fails."""
    n = MAX_GGUF_METADATA_VALUES - 2  # two fields
    ok = tmp_path / "ok.gguf"
    ok.write_bytes(gguf_bytes([ARCH, field("x.a", ARRAY, array(U8, n, bytes(n)))]))
    check_header(ok)
    GgufFile(ok)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(gguf_bytes([ARCH, field("x.a", ARRAY, array(U8, n + 1, bytes(n + 1)))]))
    with pytest.raises(ContainerError, match="65,536 metadata values"):
        check_header(bad)


@pytest.mark.parametrize("claim", [4, 5, 1 << 20, 1 << 63])
def test_every_string_length_past_the_file_is_refused(tmp_path, claim):
    p = tmp_path / "s.gguf"
    p.write_bytes(gguf_bytes([ARCH, field("x.s", STRING, struct.pack("<Q", claim) + b"abcd")]))
    if claim <= 4:
        check_header(p)
    else:
        with pytest.raises(ContainerError, match="'x.s' needs"):
            check_header(p)


def test_a_tensor_past_the_end_names_the_tensor(tmp_path):
    p = tmp_path / "t.gguf"
    p.write_bytes(gguf_bytes([ARCH], [tensor("blocks.0.norm.weight", [64])], tail=bytes(64)))
    with pytest.raises(ContainerError) as e:
        check_header(p)
    assert e.value.tensor == "blocks.0.norm.weight" and "past the file" in str(e.value)
    p.write_bytes(gguf_bytes([ARCH], [tensor("blocks.0.norm.weight", [64])], tail=bytes(512)))
    check_header(p)  # 32-byte aligned data, 256 bytes of F32: inside


def test_a_big_endian_header_is_walked(tmp_path):
    le = gguf_bytes([ARCH, field("x.bomb", ARRAY, array(U8, 1 << 60, b""))])
    be = bytearray(le)  # the counts in the other byte order (the gguf package reads both)
    be[4:24] = struct.pack(">IQQ", 3, 0, 2)
    p = tmp_path / "be.gguf"
    p.write_bytes(bytes(be))
    with pytest.raises(ContainerError, match="malformed GGUF header"):
        check_header(p)


SIGINT_CHILD = """
import sys, time
from pathlib import Path
import h3quant.formats.gguf.header as header
real = header._Walker.spend
src, flag = sys.argv[1:3]
def slow(self, n, key):
    Path(flag).write_text("walking")
    time.sleep(60)  # a header walk that takes long: SIGINT must still end it
    return real(self, n, key)
header._Walker.spend = slow
from h3quant.cli import main
sys.argv = ["h3quant", "inspect", src]
main()
"""


def test_sigint_during_a_header_walk_exits_130(bombs, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from hostile_util import ENV, ROOT

    flag = tmp_path / "flag"
    proc = subprocess.Popen([sys.executable, "-c", SIGINT_CHILD, str(bombs["1e6 strings"]),
                             str(flag)], stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err, err
