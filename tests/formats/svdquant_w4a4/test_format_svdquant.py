"""svdquant_w4a4: files in comfy-kitchen's SVDQuant W4A4 layout (built here, in both spellings
of the low-rank and smoothing tensors) read, validate and decode bit-exact as kitchen's
``TensorCoreSVDQuantW4A4Layout.dequantize``; convert reads them to any target and never writes
the format."""

import pytest
import torch

from helpers.forge import cli, codes, expect_error, validate
from helpers.kitchen_files import block_linear_names, marker_tensor, read_all
from h3quant.synth import synth_checkpoint

pytest.importorskip("comfy_kitchen")

KITCHEN = ("weight_proj_down", "weight_proj_up", "weight_smooth_factor")
QUANTS = ("proj_down", "proj_up", "smooth_factor")  # Comfy-Org comfy-quants' spelling


def _layout():
    from comfy_kitchen.tensor.svdquant_w4a4 import TensorCoreSVDQuantW4A4Layout

    return TensorCoreSVDQuantW4A4Layout


def svdquant(w: torch.Tensor, rank: int = 8, dtype=torch.bfloat16, seed: int = 0):
    """kitchen's (qdata, Params) for float ``w`` [N, K]: smoothing, a rank-``rank`` SVD branch
    on the raw input, and the residual times the smoothing quantized per group of 64 to signed
    int4 (absmax / 7), packed by kitchen's own ``_pack_int4_row_major``."""
    from comfy_kitchen.backends.eager.svdquant import _pack_int4_row_major

    n, k = w.shape
    w = w.float()
    g = torch.Generator().manual_seed(seed)
    smooth = (torch.rand(k, generator=g) + 0.5).to(dtype)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    up = (u[:, :rank] * s[:rank].sqrt()).to(dtype)
    down = (vh[:rank].t() * s[:rank].sqrt()).to(dtype)
    resid = (w - up.float() @ down.float().t()) * smooth.float()  # acts on x / smooth
    groups = resid.reshape(n, k // 64, 64)
    scale = (groups.abs().amax(-1) / 7).clamp(min=1e-8)
    q = (groups / scale.unsqueeze(-1)).round().clamp(-7, 7).to(torch.int8).reshape(n, k)
    params = _layout().Params(scale=scale.t().contiguous().to(dtype), orig_dtype=dtype,
                              orig_shape=(n, k), proj_down=down.contiguous(),
                              proj_up=up.contiguous(), smooth_factor=smooth)
    return _pack_int4_row_major(q).contiguous(), params


def kitchen_tensors(w, spelling=KITCHEN, **kw) -> dict[str, torch.Tensor]:
    """``{suffix: tensor}`` as kitchen's ``state_dict_tensors`` names them under ``weight``,
    renamed to ``spelling``."""
    q, p = svdquant(w, **kw)
    out = {"weight" + k: v.contiguous() for k, v in _layout().state_dict_tensors(q, p).items()}
    return {dict(zip(KITCHEN, spelling)).get(k, k): v for k, v in out.items()}


def kitchen_dequant(t: dict, spelling=KITCHEN) -> torch.Tensor:
    down, up, smooth = (t[s] for s in spelling)
    n, k2 = t["weight"].shape
    p = _layout().Params(scale=t["weight_scale"], orig_dtype=t["weight_scale"].dtype,
                         orig_shape=(n, 2 * k2), proj_down=down, proj_up=up, smooth_factor=smooth)
    return _layout().dequantize(t["weight"], p)


# ----------------------------------------------------------------------------- the decode
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n, k, rank", [(256, 384, 16), (96, 512, 32), (40, 1024, 4)])
def test_decode_is_kitchens_dequantize(dtype, n, k, rank):
    from h3quant.formats import registry

    gen = torch.Generator().manual_seed(n + k)
    t = {"weight": torch.randint(-128, 128, (n, k // 2), dtype=torch.int8, generator=gen),
         "weight_scale": (torch.rand(k // 64, n, generator=gen) * 0.02 + 0.01).to(dtype),
         "weight_proj_down": (torch.randn(k, rank, generator=gen) * 0.02).to(dtype),
         "weight_proj_up": (torch.randn(n, rank, generator=gen) * 0.02).to(dtype),
         "weight_smooth_factor": (torch.rand(k, generator=gen) + 0.5).to(dtype)}
    want = kitchen_dequant(t)
    codec = registry.get("svdquant_w4a4")
    got = codec.decoder.decode_weight(t, {"format": "svdquant_w4a4"}, dtype)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)
    # convert's way: row chunks through the codec's views (the low-rank branch is computed
    # for the whole layer once: a matmul over fewer rows may sum in another order)
    rows, whole = codec.decoder.source_tensors(None, t)
    whole_t = {s: t[s] for s in whole}
    views = codec.decoder.row_views(whole_t, None)
    parts = [codec.decoder.decode_rows({"weight": t["weight"][r:r + 7],
                                **{s: v[r:r + 7] for s, v in views.items()}}, whole_t, None)
             for r in range(0, n, 7)]
    assert torch.equal(torch.cat(parts), want.float())


def test_the_decode_is_what_kitchens_eager_linear_computes_on_an_identity():
    """An independent check of the arithmetic: kitchen's eager quantize + matmul on eye(K)."""
    import comfy_kitchen as ck

    from h3quant.formats.svdquant_w4a4.tensors import decode_layer

    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    q, p = svdquant(w, rank=4)
    eye = torch.eye(256, dtype=torch.bfloat16)
    qx, ascales, lora = ck.quantize_svdquant_w4a4(eye, smooth=p.smooth_factor,
                                                  lora_down=p.proj_down)
    y = ck.scaled_mm_svdquant_w4a4(act=qx, wgt=q, ascales=ascales, wscales=p.scale,
                                   lora_act_in=lora, lora_up=p.proj_up)[:256]
    got = decode_layer(q, p.scale, p.proj_down, p.proj_up, p.smooth_factor)
    assert torch.equal(got, y.t())
    rel = (got.float() - w).norm() / w.norm()
    assert rel < 0.2, rel  # the built file is a fair 4-bit SVDQuant of w


# ----------------------------------------------------------------------------- files
@pytest.fixture(scope="module")
def src(tmp_path_factory):
    p = tmp_path_factory.mktemp("svdq") / "bf16.safetensors"
    synth_checkpoint(p, preset="tiny", blocks=2, seed=9)
    return p


def svdquant_file(src, out, spelling=KITCHEN, marker=None, skip=()):
    from safetensors.torch import save_file

    t = read_all(src)
    for i, name in enumerate(block_linear_names(t)):
        if any(s in name for s in skip):
            continue
        w = t.pop(name + ".weight")
        for suffix, v in kitchen_tensors(w, spelling, seed=i).items():
            t[f"{name}.{suffix}"] = v
        m = marker or {"format": "svdquant_w4a4"}
        if name.endswith("mlp.fc2"):  # nunchaku's post-GELU layers carry act_unsigned
            m = dict(m, act_unsigned=True)
        t[name + ".comfy_quant"] = marker_tensor(m)
    save_file(t, str(out))
    return out


@pytest.fixture(scope="module", params=[KITCHEN, QUANTS], ids=["kitchen", "comfy-quants"])
def spelled(request, src, tmp_path_factory):
    out = tmp_path_factory.mktemp("svdqf") / "svdq.safetensors"
    return svdquant_file(src, out, request.param), request.param


def test_a_file_inspects_and_validates_clean(spelled):
    path, _ = spelled
    res, doc = validate(path, "--deep")
    assert res.exit_code == 0, doc["findings"]
    assert doc["counts"]["error"] == 0 and codes(doc) <= {"M113"}, doc["findings"]
    res = cli("inspect", path, "--layers")
    assert res.exit_code == 0 and "svdquant_w4a4" in res.output


def test_convert_to_bf16_is_kitchens_dequantize(src, spelled, tmp_path):
    path, spelling = spelled
    out = tmp_path / "back.safetensors"
    res = cli("convert", path, out, "--to", "bf16", "-q")
    assert res.exit_code == 0, res.output
    a, k, b = read_all(src), read_all(path), read_all(out)
    names = block_linear_names(b)
    assert len(names) == 8 and not any(n + ".comfy_quant" in b for n in names)
    for name in names:
        t = {s: k[f"{name}.{s}"] for s in ("weight", "weight_scale", *spelling)}
        assert set(b) & {f"{name}.{s}" for s in spelling} == set()
        assert torch.equal(b[name + ".weight"], kitchen_dequant(t, spelling)), name
        w = a[name + ".weight"].float()
        assert ((b[name + ".weight"].float() - w).norm() / w.norm()) < 0.2, name


@pytest.mark.parametrize("target", ["int8-convrot", "int4-convrot", "fp8"])
def test_convert_to_quantized_targets(spelled, tmp_path, target):
    path, _ = spelled
    out = tmp_path / "q.safetensors"
    res = cli("convert", path, out, "--to", target, "-q")
    assert res.exit_code == 0, res.output
    res, doc = validate(out, "--deep")
    assert res.exit_code == 0 and doc["counts"]["error"] == 0, doc["findings"]
    assert not any("svdquant" in str(v) for v in read_all(out))


def test_convert_never_writes_the_format(spelled, tmp_path):
    path, _ = spelled
    out = tmp_path / "o.safetensors"
    res = cli("convert", path, out, "--to", "int8", "--exclude", r"mlp\.fc2")
    assert res.exit_code == 2 and "read only" in res.output and not out.exists(), res.output
    assert "svdquant_w4a4" in res.output and "mlp.fc2" in res.output
    assert "svdquant" not in cli("convert", "--help").output.split("--to")[1].split("\n")[0]


@pytest.mark.slow
def test_verify_runs_the_dequantized_layers(src, spelled):
    from h3quant.pipelines.verify.blocks import verify_checkpoint

    path, _ = spelled
    res = verify_checkpoint(path, reference=src, device="cpu", blocks=[0])
    assert res.passed, res.failures
    assert {c.backend for c in res.layers} == {"dequant"}


# ----------------------------------------------------------------------------- bad files
def _one_layer(tmp_path, mutate, marker=None, spelling=KITCHEN):
    from safetensors.torch import save_file

    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    t = {f"lin.{s}": v for s, v in kitchen_tensors(w, spelling, rank=4).items()}
    t["lin.comfy_quant"] = marker_tensor(marker or {"format": "svdquant_w4a4"})
    mutate(t)
    p = tmp_path / "bad.safetensors"
    save_file({k: v.contiguous() for k, v in t.items()}, str(p))
    return p


def _drop(name):
    return lambda t: t.pop("lin." + name)


def _mix(t):
    t["lin.proj_up"] = t.pop("lin.weight_proj_up")


def _rank(t):
    t["lin.weight_proj_up"] = t["lin.weight_proj_up"][:, :3]


def _smooth(t):
    t["lin.weight_smooth_factor"] = t["lin.weight_smooth_factor"][:128]


def _scale_shape(t):
    t["lin.weight_scale"] = t["lin.weight_scale"].t()


def _nan_smooth(t):
    s = t["lin.weight_smooth_factor"].clone()
    s[5] = float("nan")
    t["lin.weight_smooth_factor"] = s


@pytest.mark.parametrize("mutate, code, extra", [
    (_drop("weight_proj_up"), "Q101", ()),
    (_drop("weight_scale"), "Q101", ()),
    (_mix, "Q124", ()),
    (_rank, "Q124", ()),
    (_smooth, "Q124", ()),
    (_scale_shape, "Q103", ()),
    (_nan_smooth, "D101", ("--deep",)),
])
def test_broken_layers_get_findings(tmp_path, mutate, code, extra):
    expect_error(_one_layer(tmp_path, mutate), code, *extra)


@pytest.mark.parametrize("marker", [{"format": "svdquant_w4a4", "layout": "kitchen_tile_packed_w4a4"},
                                    {"format": "svdquant_w4a4", "group_size": 128}])
def test_unread_layouts_are_refused(tmp_path, marker):
    p = _one_layer(tmp_path, lambda t: None, marker)
    expect_error(p, "Q125")
    out = tmp_path / "o.safetensors"
    res = cli("convert", p, out, "--to", "bf16", "--preset", "all-linears")
    assert res.exit_code == 2 and "Q125" in res.output and not out.exists(), res.output


def test_a_clean_single_layer_in_either_spelling(tmp_path):
    for spelling in (KITCHEN, QUANTS):
        res, doc = validate(_one_layer(tmp_path, lambda t: None, spelling=spelling), "--deep")
        assert doc["counts"]["error"] == 0, doc["findings"]
