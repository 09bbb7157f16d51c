"""Forged and minimal checkpoints for the container, marker, scheme and pipeline tests.

``raw_file`` writes arbitrary header bytes and data byte by byte (no validation), so tests can
break exactly one rule at a time. The ``*_layer`` helpers build legal tensors for one layer.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from h3quant.formats.container.dtypes import itemsize
from h3quant.formats.markers import HEADER_KEY, header_metadata_value, marker_tensor
from h3quant.formats.container.writer import save_tensors

INT8_CONVROT = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}
W4A8 = {"format": "asym_w4a8_int8", "group_size": 16, "convrot_groupsize": 256}


# ----------------------------------------------------------------------------- raw bytes


def header_json(obj) -> bytes:
    """Compact JSON padded with spaces to a multiple of 8 (what the safetensors writer makes)."""
    text = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    return text + b" " * (-len(text) % 8)


def raw_file(path: Path, header: bytes | dict | list, data: bytes = b"", *,
             length: int | None = None) -> Path:
    """u64 ``length`` (default: len(header)) + header bytes + data, exactly as given."""
    hb = header if isinstance(header, bytes) else header_json(header)
    n = len(hb) if length is None else length
    Path(path).write_bytes(struct.pack("<Q", n) + hb + data)
    return Path(path)


def layout(specs: dict[str, tuple[str, list]]) -> tuple[dict, bytes]:
    """(header dict, zero data) placing ``{name: (dtype, shape)}`` back to back in order."""
    header: dict = {}
    pos = 0
    for name, (dtype, shape) in specs.items():
        nbytes = math.prod(shape) * itemsize(dtype)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    return header, bytes(pos)


def simple(path: Path, mutate=None, *, data_extra: bytes = b"", cut: int = 0) -> Path:
    """A two-tensor F32 file; ``mutate(header)`` edits the header dict before writing."""
    header, data = layout({"a.weight": ("F32", [2, 4]), "b.weight": ("F32", [4])})
    if mutate is not None:
        mutate(header)
    data = data + data_extra
    return raw_file(path, header, data[: len(data) - cut] if cut else data)


# ----------------------------------------------------------------------------- legal layers


def float_layer(name: str, n: int = 8, k: int = 256, *, bias: bool = False,
                dtype=torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {f"{name}.weight": torch.randn(n, k, generator=g).to(dtype)}
    if bias:
        t[f"{name}.bias"] = torch.randn(n, generator=g).to(dtype)
    return t


def int8_layer(name: str, n: int = 8, k: int = 256, *, marker: dict | torch.Tensor | None = None,
               scale_shape: tuple | None = None, bias: bool = False, seed: int = 0,
               with_marker: bool = True) -> dict[str, torch.Tensor]:
    """An int8_tensorwise layer with codes in [-127, 127] and positive scales."""
    g = torch.Generator().manual_seed(seed)
    shape = (n, 1) if scale_shape is None else tuple(scale_shape)
    t = {
        f"{name}.weight": torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
        f"{name}.weight_scale": torch.rand(shape, generator=g) + 0.01,
    }
    if bias:
        t[f"{name}.bias"] = torch.randn(n, generator=g).bfloat16()
    if with_marker:
        m = INT8_CONVROT if marker is None else marker
        t[f"{name}.comfy_quant"] = m if isinstance(m, torch.Tensor) else marker_tensor(m)
    return t


def w4a8_layer(name: str, n: int = 8, k: int = 256, *, group: int = 16, codebook: bool = True,
               marker: dict | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """An asym_w4a8_int8 layer: packed codes [N, K/2], e4m3 s_rel [N, K/G], f32 s_channel [N]."""
    g = torch.Generator().manual_seed(seed)
    t = {
        f"{name}.weight": torch.randint(-128, 128, (n, k // 2), generator=g, dtype=torch.int8),
        f"{name}.weight_s_rel": (torch.rand(n, k // group, generator=g) * 100 + 1).to(
            torch.float8_e4m3fn),
        f"{name}.weight_s_channel": torch.rand(n, generator=g) + 0.01,
        f"{name}.comfy_quant": marker_tensor(W4A8 if marker is None else marker),
    }
    if codebook:
        t[f"{name}.weight_codebook"] = torch.linspace(-0.98, 0.98, 16)
    return t


def markers_of(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """``{layer: fields}`` from the marker tensors in ``tensors`` (for header metadata)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".comfy_quant"):
            out[name[: -len(".comfy_quant")]] = json.loads(bytes(t.tolist()).decode())
    return out


def save(path: Path, tensors: dict[str, torch.Tensor], *, header: bool | dict = True,
         metadata: dict | None = None) -> Path:
    """save_tensors with ``_quantization_metadata`` built from the markers (``header=True``),
    given explicitly (a dict of layers), or left out (``header=False``)."""
    meta = dict(metadata or {})
    layers = markers_of(tensors) if header is True else (header or None)
    if layers:
        meta[HEADER_KEY] = header_metadata_value(layers)
    save_tensors(path, tensors, meta or None)
    return Path(path)


# ----------------------------------------------------------------------------- CLI


def cli(*args):
    """Invoke ``h3quant ARGS`` in-process; fail if anything but SystemExit escaped."""
    from click.testing import CliRunner

    from h3quant.cli import main

    res = CliRunner().invoke(main, [str(a) for a in args])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise AssertionError(f"h3quant {' '.join(map(str, args))} raised "
                             f"{type(res.exception).__name__}: {res.exception}") from res.exception
    assert "Traceback" not in res.output
    return res


def validate(path, *extra) -> tuple[object, dict]:
    """(click result, parsed --json document) of ``h3quant validate PATH --json``."""
    res = cli("validate", path, "--json", *extra)
    return res, json.loads(res.stdout)


def codes(doc: dict) -> set[str]:
    return {f["code"] for f in doc["findings"]}


def expect_error(path, code: str, *extra) -> dict:
    """validate exits 1, ``code`` is among the findings, and every finding is well-formed."""
    res, doc = validate(path, *extra)
    assert res.exit_code == 1, (res.exit_code, doc)
    assert code in codes(doc), doc["findings"]
    assert doc["ok"] is False and doc["counts"]["error"] >= 1
    for f in doc["findings"]:
        assert set(f) == {"code", "name", "severity", "tensor", "file", "message"}
        assert f["message"]
    return doc


# ----------------------------------------------------------------------------- H3


def quantized_synth(path: Path, *, header: bool = True, seed: int = 0) -> Path:
    """The tiny synthetic H3 with its block linears replaced by (random) int8 ConvRot layers."""
    from h3quant.formats.container.checkpoint import Checkpoint
    from h3quant.h3.topology import is_h3_block_linear
    from h3quant.synth import synth_checkpoint

    plain = Path(path).with_suffix(".plain.safetensors")
    synth_checkpoint(plain, preset="tiny", seed=seed)
    tensors: dict[str, torch.Tensor] = {}
    with Checkpoint(plain) as ck:
        for name in ck.tensors:
            layer = name[: -len(".weight")]
            if name.endswith(".weight") and is_h3_block_linear(layer):
                n, k = ck.tensors[name].shape
                tensors.update(int8_layer(layer, n, k, seed=len(tensors)))
            else:
                tensors[name] = ck.read(name).clone()
    plain.unlink()
    return save(path, tensors, header=header)
