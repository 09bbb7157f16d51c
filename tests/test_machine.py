"""Device profiles, `backends --profile`, `plan --device` and `validate --loader`.

The profiles are checked against comfy-kitchen's own layout classes (their MIN_SM_VERSION and
supports_fast_matmul), not against h3quant's table; the machine plans run on a full-dims H3
checkpoint whose header is real and whose data is a sparse hole (nothing of it is read)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner
from h3quant import device_profiles
from h3quant.cli import main
from h3quant.formats import registry
from h3quant.h3 import topology


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


# --------------------------------------------------------------------- profiles vs comfy-kitchen
def _kitchen_layouts():
    ck = pytest.importorskip("comfy_kitchen.tensor")
    return {name: getattr(ck, name) for name in dir(ck) if name.endswith("Layout")}


def test_profiles_agree_with_kitchen_min_sm_version():
    layouts = _kitchen_layouts()
    checked = 0
    for spec in registry.specs():
        if spec.runtime.kitchen is None:
            continue
        cls = layouts[spec.runtime.kitchen.layout]
        kitchen_min = tuple(cls.MIN_SM_VERSION) if cls.MIN_SM_VERSION is not None else None
        assert kitchen_min == spec.runtime.kitchen.min_sm, spec.name
        checked += 1
    assert checked >= 7


def test_profiles_follow_kitchens_fast_matmul_rule(monkeypatch):
    """For each NVIDIA class, kitchen's supports_fast_matmul() under that capability decides
    native; without CUDA (Apple, Ascend, CPU) it is False for every layout with a minimum."""
    import comfy_kitchen.tensor.base as base

    layouts = _kitchen_layouts()
    for c in device_profiles.CLASSES:
        monkeypatch.setattr(base, "get_cuda_capability", lambda sm=c.sm: sm)
        for spec in registry.specs():
            if spec.runtime.kitchen is None:
                continue
            layout = layouts[spec.runtime.kitchen.layout]
            if "get_cuda_capability" in layout.supports_fast_matmul.__func__.__code__.co_names:
                # a layout overriding the rule reads the name through its own module
                mod = __import__(layout.__module__, fromlist=["x"])
                monkeypatch.setattr(mod, "get_cuda_capability", lambda sm=c.sm: sm,
                                    raising=False)
            assert layout.supports_fast_matmul() == device_profiles.native(spec, c), \
                (c.name, spec.name)


def test_classes_by_capability():
    assert device_profiles.for_capability((8, 6)).name == "ampere"
    assert device_profiles.for_capability((8, 9)).name == "ada"
    assert device_profiles.for_capability((12, 1)).name == "blackwell"
    assert device_profiles.for_capability((10, 3)).name == "blackwell-dc"
    assert device_profiles.for_capability((7, 0)) is None


def test_npu_layout_one_answer_everywhere(tmp_path):
    kn = registry.spec(next(s.name for s in registry.specs() if s.canonical))
    line = device_profiles.load_line(kn)
    assert "refuses" in line and "without --layout npu" in line
    assert all(device_profiles.cell(kn, c) == "refused" for c in device_profiles.CLASSES)
    res = cli("backends", "--profile", "ascend")
    assert res.exit_code == 0 and line.split(";")[0] in " ".join(res.output.split())


def test_backends_lines_fit_100_columns():
    for args in (("--device", "npu"), ("--device", "cpu"), ("--profile", "all"),
                 ("--profile", "ada")):
        res = cli("backends", *args)
        assert res.exit_code == 0, res.output
        assert max(len(x) for x in res.output.splitlines()) <= 100, args


def test_backends_npu_does_not_contradict_itself():
    """Without torch_npu no backend is available, so h3quant runs no format there (it used to
    say "nothing available" and then "h3quant runs: dequant" for every format)."""
    out = cli("backends", "--device", "npu").output
    pytest.importorskip("torch")
    if "nothing: no backend is available" not in out:
        pytest.skip("this machine has an NPU backend")
    lines = out.split("per format\n")[1].splitlines()
    assert lines[0].split()[:3] == ["format", "h3quant", "runs"]
    rows = [r.split() for r in lines[2:] if r and not r.startswith(" ") and ":" not in r]
    assert len(rows) >= 8 and all(r[1] == "-" for r in rows), rows
    assert {r[0]: r[2] for r in rows}[registry.spec("int8_tensorwise_kn").name] == "refused"


def test_backends_bad_profile_is_usage_error():
    res = cli("backends", "--profile", "rtx9000")
    assert res.exit_code == 2 and "unknown device class" in res.output


# --------------------------------------------------------------------- machine plans
def _sparse_full(path: Path) -> Path:
    """The full preset's pruned BF16 checkpoint: a real header, the data a sparse hole."""
    cfg = topology.config_for("full")
    tensors = topology.expected_tensors(cfg)
    size = {"BF16": 2, "F32": 4}
    header, off = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = size[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + off)
    return path


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    return _sparse_full(tmp_path_factory.mktemp("full") / "h3_full_bf16.safetensors")


def _plan(full, *args):
    res = cli("plan", full, *args, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_plan_8gb_ampere(full, tmp_path):
    before = sorted(p.name for p in full.parent.iterdir())
    doc = _plan(full, "--device", "ampere", "--vram", "8GB")
    assert doc["device_class"] == "ampere" and not doc["current"]["fits"]
    # every candidate the plan may pick runs natively on Ampere (per kitchen's rule above)
    assert doc["choice"] is None  # 33B parameters do not fit 8 GB in any format
    assert "out of reach" in doc["verdict"] and doc["suggestions"]
    assert "offload" in doc["suggestions"][0]
    # the weights of a 4-bit format are about a quarter of BF16's block linears
    by = {c["target"]: c for c in doc["candidates"]}
    assert by["w4a8"]["cell"] == "native" and by["nvfp4"]["cell"] == "dequant"
    assert by["w4a8"]["weights"] < 0.35 * doc["current"]["weights"]
    assert sorted(p.name for p in full.parent.iterdir()) == before  # nothing written


def test_plan_16gb_ada_and_text(full):
    doc = _plan(full, "--device", "ada", "--vram", "16GB", "--resolution", "640x368",
                "--frames", "49")
    by = {c["target"]: c for c in doc["candidates"]}
    assert by["fp8"]["cell"] == "native" and by["int4-convrot"]["cell"] == "native"
    # tokens from the stated assumption: 13 latent frames x 12 x 20 patches
    assert doc["tokens"] == 13 * 12 * 20
    assert doc["activations"] == doc["tokens"] * 2 * (4 * 5376 + 3 * 14336)
    fit = [c for c in doc["candidates"] if c["fits"] and c["cell"] == "native"]
    if fit:
        assert doc["choice"] == max(fit, key=lambda c: c["weights"])["target"]
    else:
        assert doc["choice"] is None and doc["suggestions"]
    text = cli("plan", full, "--device", "ada", "--vram", "16GB").output
    assert "assumptions" in text and "offload" in text
    assert max(len(x) for x in text.splitlines()) <= 100


def test_plan_that_fits_writes_nothing(full):
    doc = _plan(full, "--device", "hopper", "--vram", "141GB")
    assert doc["current"]["fits"] and doc["choice"] is None
    assert "already fits" in doc["verdict"]


def test_plan_device_usage_errors(full):
    assert cli("plan", full, "--device", "ada").exit_code == 2
    assert cli("plan", full, "--device", "voodoo", "--vram", "8GB").exit_code == 2
    assert cli("plan", full, "--device", "ada", "--vram", "8GB", "--resolution", "big") \
        .exit_code == 2


# --------------------------------------------------------------------- other loaders
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from h3quant.pipelines.convert import ConvertOptions, convert
    from h3quant.synth import synth_checkpoint

    d = tmp_path_factory.mktemp("loaders")
    bf16 = d / "bf16.safetensors"
    synth_checkpoint(bf16, preset="tiny", blocks=1)
    out = {"bf16": bf16}
    for key, target, layout in (("int8", "int8-convrot", "canonical"),
                                ("kn", "int8-convrot", "npu"), ("w4a8", "w4a8", "canonical")):
        out[key] = d / f"{key}.safetensors"
        convert(bf16, out[key], ConvertOptions(target=target, layout=layout, report=False))
    return out


def _codes(path, loader):
    res = cli("validate", path, "--loader", loader, "--json")
    doc = json.loads(res.output)
    return res.exit_code, [f["code"] for f in doc["findings"]]


def test_comfyui_refuses_the_npu_layout(files):
    assert _codes(files["int8"], "comfyui") == (0, [])
    rc, codes = _codes(files["kn"], "comfyui")
    assert rc == 1 and "L101" in codes


def test_vllm_omni_takes_int8_convrot_only(files):
    assert _codes(files["int8"], "vllm-omni") == (0, [])
    for key in ("w4a8", "kn", "bf16"):
        rc, codes = _codes(files[key], "vllm-omni")
        assert rc == 1 and "L111" in codes, key


def _gguf(path, arch, names):
    """A GGUF v3 file written byte by byte: F32 [2, 32] tensors, general.architecture only when
    ``arch`` is given (else kv_count 0, as the metadata-less H3 conversions ship)."""
    def text(s):
        b = s.encode()
        return struct.pack("<Q", len(b)) + b

    kv = [text("general.architecture") + struct.pack("<I", 8) + text(arch)] if arch else []
    out = b"GGUF" + struct.pack("<IQQ", 3, len(names), len(kv)) + b"".join(kv)
    nbytes = 2 * 32 * 4
    for i, n in enumerate(names):
        out += text(n) + struct.pack("<I", 2) + struct.pack("<QQ", 32, 2)
        out += struct.pack("<IQ", 0, i * nbytes)  # F32, offset in the data section
    out += b"\0" * (-len(out) % 32)
    out += b"\0" * (nbytes * len(names))
    path.write_bytes(out)
    return path


def test_comfyui_gguf_rules(files, tmp_path):
    keys = ("adaln_t_table", "blocks.0.adaln_proj.linear.weight", "blocks.0.attn.qkv_proj.weight")
    rc, codes = _codes(files["int8"], "comfyui-gguf")
    assert rc == 1 and codes == ["L121"]
    wan = _gguf(tmp_path / "wan.gguf", "wan", keys)
    assert "L121" in _codes(wan, "comfyui-gguf")[1]
    bare = _gguf(tmp_path / "bare.gguf", None, keys[1:])  # kv_count 0, no adaln_t_table
    assert "L121" in _codes(bare, "comfyui-gguf")[1]
    ok = _gguf(tmp_path / "ok.gguf", None, keys)
    assert "L121" not in _codes(ok, "comfyui-gguf")[1]
    assert "L101" in _codes(ok, "comfyui")[1]


def test_validate_and_inspect_print_the_load_line(files):
    out = cli("validate", files["kn"]).output
    assert "loads  " in out and "without --layout npu" in " ".join(out.split())
    out = cli("inspect", files["w4a8"]).output
    assert "native kernel on NVIDIA sm_80+" in " ".join(out.split())
    assert max(len(x) for x in out.splitlines()[-6:]) <= 100
