"""Version 3 statistics: each Hessian stored as its upper triangle. The packing against an
independent layout (``torch.triu_indices``), capture's ``X^T X`` symmetric bit for bit (so the
half loses nothing), a calibrated convert from the packed file byte for byte the one from the
same statistics written whole (version 2), header rules of a packed file, and version 2 files
still read."""

from __future__ import annotations

import json

import pytest
import torch

from h3quant.calibration.stats import Statistics, pack_upper, packed_size, unpack_upper
from h3quant.errors import UsageError
from h3quant.synth import synth_checkpoint

from helpers.inputs import input_dims, seeded_inputs


def _sym(k, seed=0):
    x = torch.randn(k + 7, k, generator=torch.Generator().manual_seed(seed))
    return x.t() @ x


@pytest.mark.parametrize("k", [1, 2, 3, 17, 640])
def test_packing_is_the_row_major_upper_triangle(k):
    h = _sym(k, k)
    i, j = torch.triu_indices(k, k)
    p = pack_upper(h)
    assert p.shape == (packed_size(k),) == (k * (k + 1) // 2,)
    assert torch.equal(p, h[i, j])
    full = torch.empty(k, k)
    full[i, j] = p
    full[j, i] = p
    assert torch.equal(unpack_upper(p, k), full)
    assert torch.equal(unpack_upper(p, k), h)  # h was symmetric: nothing lost


def test_unpacking_ignores_the_lower_triangle_it_never_saw():
    h = _sym(33)
    h[20, 3] += 1.0  # the lower triangle is not stored: the upper value wins
    assert unpack_upper(pack_upper(h), 33)[20, 3] == h[3, 20]


def test_the_recorded_second_moment_is_symmetric_bit_for_bit():
    """What capture accumulates (``Recording``: ``H += x^T x`` per call) is exactly symmetric on
    the CPU, so its upper triangle holds every value of the whole matrix."""
    from h3quant.calibration.capture import Recording

    rec = Recording(torch.nn.Identity(), 300, "cpu")
    g = torch.Generator().manual_seed(1)
    for rows in (256, 77, 512):
        rec(torch.randn(rows, 300, generator=g) * (1 + 5 * (torch.rand(300, generator=g) < .05)))
    assert torch.equal(rec.h, rec.h.t())


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from h3quant.pipelines.capture import capture_statistics

    d = tmp_path_factory.mktemp("packed")
    src = d / "bf16.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=1, seed=5)
    ins = seeded_inputs(d, input_dims(src), range(5))  # 1280 rows >= K = 1024 (fc2)
    stats = d / "a.stats"
    capture_statistics(src, ins, stats, predict=False)
    return {"d": d, "src": src, "stats": stats}


def _as_version_2(packed_path, out):
    """The same statistics written as version 2 (each Hessian whole), built here from the packed
    values with ``triu_indices``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(packed_path), "pt") as f:
        meta = json.loads(f.metadata()["h3quant.calibration"])
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    for n in [n for n in tensors if n.endswith(".hessian")]:
        k = tensors[n[:-len(".hessian")] + ".absmean"].numel()
        i, j = torch.triu_indices(k, k)
        full = torch.empty(k, k)
        full[i, j] = tensors[n]
        full[j, i] = tensors[n]
        tensors[n] = full
    meta["version"] = 2
    save_file(tensors, str(out), metadata={"h3quant.calibration": json.dumps(meta)})
    return out


def test_capture_writes_the_packed_half(world):
    from safetensors import safe_open

    with safe_open(str(world["stats"]), "pt") as f:
        meta = json.loads(f.metadata()["h3quant.calibration"])
        shape = f.get_slice("blocks.0.mlp.fc2.hessian").get_shape()
    assert meta["version"] == 3 and shape == [1024 * 1025 // 2]
    old = _as_version_2(world["stats"], world["d"] / "v2.stats")
    with Statistics(world["stats"]) as new, Statistics(old) as was:
        assert was.meta["version"] == 2 and new.packed and not was.packed
        for key, lay in new.layers.items():
            assert torch.equal(lay.hessian(), was.layers[key].hessian()), key
        saved = sum(2 * lay.k * (lay.k - 1) for lay in new.layers.values())  # 4 (K^2 - K(K+1)/2)
    # the lower triangles' bytes, less a few header bytes (the shapes' text)
    assert abs(old.stat().st_size - world["stats"].stat().st_size - saved) < 512


@pytest.mark.slow
@pytest.mark.parametrize("target", ["int8-convrot", "nvfp4"])
def test_convert_from_the_packed_file_has_the_whole_files_bytes(world, target):
    from h3quant.pipelines.convert import ConvertOptions, convert

    d = world["d"]
    old = d / "v2.stats"
    if not old.exists():
        _as_version_2(world["stats"], old)
    outs = []
    for name, stats in (("packed", world["stats"]), ("whole", old)):
        outs.append(d / f"{target}_{name}.safetensors")
        convert(world["src"], outs[-1], ConvertOptions(target=target, calibration=str(stats),
                                                       report=False, overwrite=True))
    from h3quant.formats.container.checkpoint import Checkpoint

    with Checkpoint(outs[0]) as a, Checkpoint(outs[1]) as b:
        assert set(a.tensors) == set(b.tensors)
        for n in a.tensors:
            assert bytes(a.read_bytes(n)) == bytes(b.read_bytes(n)), n


def _edited(world, name, edit):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(world["stats"]), "pt") as f:
        md = f.metadata()
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    md = edit(tensors, md) or md
    out = world["d"] / name
    save_file(tensors, str(out), metadata=md)
    return out


def test_a_packed_hessian_of_the_wrong_length_is_named(world):
    key = "blocks.0.attn.out_proj.hessian"

    def edit(t, md):
        t[key] = t[key][:-1].clone()

    with pytest.raises(UsageError, match=r"upper triangle of the \[512, 512\] matrix") as e:
        Statistics(_edited(world, "short.stats", edit))
    assert e.value.tensor == key


def test_a_whole_matrix_in_a_version_3_file_is_refused(world):
    key = "blocks.0.attn.out_proj.hessian"

    def edit(t, md):
        t[key] = unpack_upper(t[key], 512)

    with pytest.raises(UsageError, match=r"F32 \[131328\]"):
        Statistics(_edited(world, "whole-in-v3.stats", edit))


def test_a_packed_hessian_breaking_the_gram_rule_is_refused(world):
    key = "blocks.0.mlp.fc1.hessian"

    def edit(t, md):
        t[key][1] = 10 * t[key][0] + 10 * t[key][512]  # H[0, 1] beyond sqrt(H00 H11)

    with pytest.raises(UsageError, match="not a sum X\\^T X") as e:
        Statistics(_edited(world, "tilt.stats", edit))
    assert e.value.tensor == key


def test_a_later_version_is_refused_by_name(world):
    def edit(t, md):
        meta = json.loads(md["h3quant.calibration"])
        meta["version"] = 4
        return {"h3quant.calibration": json.dumps(meta)}

    with pytest.raises(UsageError, match="statistics version 4 is not one of 1, 2, 3"):
        Statistics(_edited(world, "v4.stats", edit))
