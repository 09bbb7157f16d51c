"""Property-based fuzzing of the parsers that read untrusted bytes: the safetensors header and
the quantization markers (per-layer tensor and header metadata). Whatever the input, they answer
with findings or a coded MarkerError, never another exception, and what they accept is coherent."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from h3quant.errors import MarkerError
from h3quant.formats import registry
from h3quant.formats.container.reader import MAX_HEADER_BYTES, parse_header
from h3quant.formats.container.dtypes import DTYPES, itemsize
from h3quant.formats.markers import (
    effective_fields,
    known_format_names,
    marker_bytes,
    parse_header_metadata,
    parse_marker_bytes,
)

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PATH = Path("fuzz.safetensors")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=20,
)


def _parse(header: bytes, data_len: int):
    raw_len = struct.pack("<Q", len(header))
    return parse_header(raw_len, lambda n: header[:n], 8 + len(header) + data_len, PATH)


def _coherent(parsed, data_len: int) -> None:
    """Every accepted tensor has the byte size its dtype and shape need, lies inside the data
    buffer, and no two accepted tensors overlap."""
    spans = []
    for info in parsed.tensors.values():
        assert info.dtype in DTYPES
        assert info.end - info.begin == math.prod(info.shape) * itemsize(info.dtype)
        base = 8 + parsed.header_len
        assert base <= info.begin <= info.end <= base + data_len
        spans.append((info.begin, info.end))
    spans.sort()
    for (b0, e0), (b1, e1) in zip(spans, spans[1:]):
        assert e0 <= b1 or b1 == e1 or b0 == e0
    for f in parsed.findings:
        assert f.code.startswith("C")


@SETTINGS
@given(st.binary(max_size=256), st.integers(0, 64))
def test_header_parser_survives_arbitrary_bytes(header, data_len):
    _coherent(_parse(header, data_len), data_len)


@SETTINGS
@given(st.binary(max_size=8), st.integers(0, 2**64 - 1))
def test_header_length_field_is_bounded(raw_len, claimed):
    """A short or huge length field is a finding, never a read of the claimed size."""
    reads = []

    def read(n):
        reads.append(n)
        return b"{}"[:n]

    raw = raw_len if len(raw_len) < 8 else struct.pack("<Q", claimed)
    parsed = parse_header(raw, read, 4096, PATH)
    assert all(n <= min(MAX_HEADER_BYTES, 4096) for n in reads)
    if len(raw) < 8 or claimed > 4096 - 8:
        assert parsed.findings and not parsed.tensors


entries = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(sorted(DTYPES)) | json_values,
        "shape": st.lists(st.integers(-2, 6), max_size=3) | json_values,
        "data_offsets": st.lists(st.integers(-4, 300), min_size=0, max_size=3) | json_values,
    },
)


@SETTINGS
@given(st.dictionaries(st.text(max_size=10), entries | json_values, max_size=6),
       st.one_of(st.none(), json_values), st.integers(0, 300))
@pytest.mark.slow
def test_header_parser_survives_arbitrary_entries(tensors, meta, data_len):
    obj = dict(tensors)
    if meta is not None:
        obj["__metadata__"] = meta
    header = json.dumps(obj).encode()
    header += b" " * (-len(header) % 8)
    _coherent(_parse(header, data_len), data_len)


def _marker_contract(raw: bytes) -> None:
    try:
        obj = parse_marker_bytes(raw)
    except MarkerError as exc:
        assert exc.code and exc.code.startswith("M")
        return
    assert isinstance(obj, dict) and obj["format"] in known_format_names()
    try:
        fields = effective_fields(obj)
    except MarkerError as exc:
        assert exc.code == "M114"
        return
    assert fields["format"] == obj["format"]
    assert isinstance(fields["full_precision_matrix_mult"], bool)


@SETTINGS
@given(st.binary(max_size=128))
def test_marker_parser_survives_arbitrary_bytes(raw):
    _marker_contract(raw)


@pytest.mark.slow
@SETTINGS
@given(json_values)
def test_marker_parser_survives_arbitrary_json(value):
    _marker_contract(json.dumps(value).encode())


@SETTINGS
@given(st.sampled_from(sorted(known_format_names())),
       st.dictionaries(st.sampled_from(["convrot", "convrot_groupsize", "group_size",
                                        "full_precision_matrix_mult", "params", "extra"]),
                       json_values, max_size=4))
@pytest.mark.slow
def test_marker_fields_are_typed_or_refused(fmt, extra):
    """A marker naming a known format either yields typed fields or a coded M114 refusal."""
    _marker_contract(json.dumps({"format": fmt, **extra}).encode())


@pytest.mark.slow
@SETTINGS
@given(st.text(max_size=64) | json_values.map(json.dumps))
def test_header_metadata_parser(value):
    try:
        layers = parse_header_metadata({"_quantization_metadata": value})
    except MarkerError as exc:
        assert exc.code == "M111"
    else:
        assert isinstance(layers, dict)


@SETTINGS
@given(json_values | st.sampled_from(sorted(known_format_names())),
       st.dictionaries(st.text(max_size=8), json_values, max_size=3))
@pytest.mark.slow
def test_marker_with_any_format_value(fmt, extra):
    """A ``format`` of any JSON type (list, object, number ...) is a coded refusal or accepted."""
    _marker_contract(json.dumps({**extra, "format": fmt}).encode())


@SETTINGS
@given(st.sampled_from([t for t in registry.targets()]), st.sampled_from([4, 16, 64, 256, 1024]))
def test_every_written_marker_parses_back(target, group_size):
    """What each registered convert target writes parses back to the same object."""
    marker = registry.target_codec(target).spec.planning.marker(registry.target(target), group_size)
    if marker is None:
        return
    assert parse_marker_bytes(marker_bytes(marker)) == marker
    assert effective_fields(marker)["format"] == marker["format"]
