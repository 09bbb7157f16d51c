""""Convert the release, verify against the release": every reader of a source or reference
(``verify --reference`` per block and ``--model``, ``plan``) takes the layouts ``convert``
takes (official shards, diffusers shards, scaled fp8), through the view ``convert`` uses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.forge import cli
from helpers.hf_cache import hf_cache_snapshot

from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.sources import open_as_comfy
from h3quant.synth import synth_checkpoint
from h3quant.synth.layouts import write_layout


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    comfy = root / "h3.safetensors"
    synth_checkpoint(comfy, preset="tiny", seed=0)
    out = {"comfy": comfy}
    for layout in ("official", "diffusers"):
        write_layout(comfy, root / layout, layout)
        out[layout] = root / layout
    write_layout(comfy, root / "fp8.safetensors", "comfy", fp8=True)
    out["fp8"] = root / "fp8.safetensors"
    out["hf-cache"] = hf_cache_snapshot(root / "official", root / "hub")
    return out


@pytest.mark.parametrize("kind", ["official", "diffusers", "fp8", "hf-cache"])
def test_convert_the_release_then_verify_against_it(sources, tmp_path, kind):
    src = sources[kind]
    out = tmp_path / "h3_int8.safetensors"
    res = cli("convert", src, out, "--to", "int8-convrot", "-q")
    assert res.exit_code == 0, res.output
    res = cli("verify", out, "--reference", src, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["reference"] == str(src)
    res = cli("verify", out, "--reference", src, "--model", "--json")
    assert res.exit_code == 0, res.output


def _independent_comfy(kind: str, src: Path) -> dict[str, torch.Tensor]:
    """The ComfyUI tensors of a layout, computed here from the layout's own definition."""
    with Checkpoint(src) as ck:
        t = {n: ck.read(n) for n in ck.tensors}
    if kind == "official":
        for n, x in list(t.items()):
            if n.endswith(".attn.qkv_proj.weight"):
                d = t[n.replace("qkv_proj.weight", "q_norm.weight")].shape[0]
                h = x.shape[0] // (3 * d)
                t[n] = x.reshape(h, 3, d, -1).transpose(0, 1).reshape(x.shape)
    if kind == "fp8":
        for n in [n for n in t if n.endswith(".scale_weight")]:
            w = n[: -len(".scale_weight")] + ".weight"
            t[w] = t[w].float() * t.pop(n).float()
    return t


@pytest.mark.parametrize("kind", ["official", "fp8"])
def test_the_view_gives_comfy_names_and_values(sources, kind):
    want = _independent_comfy(kind, sources[kind])
    with open_as_comfy(sources[kind]) as view:
        assert set(view.tensors) <= set(want) | {"rope.inv_freq"}
        for n in view.tensors:
            got = view.read(n)
            assert torch.equal(got.to(want[n].dtype), want[n]), n


@pytest.mark.slow  # two sensitivity passes (about a minute on a loaded 2-core machine)
def test_plan_reads_the_official_layout(sources, tmp_path):
    def units(src):
        res = cli("plan", src, "--formats", "int8-convrot", "--json")
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)["sensitivity"]["units"]

    assert units(sources["official"]) == units(sources["comfy"])
