"""Smoothing: the fold is exact (h3quant's runtime and an independent forward), a wrongly
folded row is caught, capture records channel maxima and sampled rows, ``convert --smooth``
keeps ComfyUI's key set and markers, folds what it says into the float tensors, and
comfy-kitchen decodes every smoothed layer as its marker says."""

from __future__ import annotations

import json

import pytest
import torch

from h3quant.calibration import smooth
from h3quant.calibration.stats import Statistics
from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.container.writer import save_tensors
from h3quant.synth import synth_checkpoint

from helpers.h3files import read_tensors
from helpers.inputs import input_dims, seeded_inputs

LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from h3quant.pipelines.capture import capture_statistics

    d = tmp_path_factory.mktemp("smooth")
    src = d / "bf16.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=2, seed=5)
    ins = seeded_inputs(d, input_dims(src), range(5))
    stats = d / "a.stats"
    capture_statistics(src, ins, stats, predict=False)
    return {"d": d, "src": src, "inputs": ins, "stats": stats}


def _random_factors(tensors, seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(2):
        for lin in LINEARS:
            k = tensors[f"blocks.{i}.{lin}.weight"].shape[1]
            out[(i, lin)] = torch.pow(2.0, torch.randint(-3, 4, (k,), generator=g).float())
    return out


def _smoothed_file(world, name, factors, spoil=None):
    """The float file with ``factors`` folded by ``fold_block``; ``spoil(tensors)`` breaks it."""
    tensors, meta = read_tensors(world["src"])
    for i in range(2):
        p = f"blocks.{i}."
        block = {k[len(p):]: v for k, v in tensors.items() if k.startswith(p)}
        changed = smooth.fold_block(block, {lin: factors[(i, lin)] for lin in LINEARS})
        tensors.update({p + k: v for k, v in changed.items()})
    if spoil is not None:
        spoil(tensors)
    out = world["d"] / name
    save_tensors(out, tensors, meta)
    return out


def _inputs(world):
    from h3quant.pipelines.inputs_file import load_sigma, load_tensors
    from h3quant.runtime.model.model import H3Model

    with H3Model.open(world["src"]) as m:
        return load_tensors(world["inputs"][0], m.video_channels, m.audio_channels,
                            m.text_dim), load_sigma(world["inputs"][0])


def _runtime(path, ins, sigma):
    from h3quant.runtime.model.model import H3Model

    with H3Model.open(path, linear="reference") as m, torch.no_grad():
        return m(*(t.float() for t in ins), sigma)


def _independent(path, ins, sigma):
    from helpers import independent_h3 as ind

    src, _ = read_tensors(path)
    with torch.no_grad():
        return ind.forward(src, *(t.float() for t in ins), sigma)


_BASE: dict = {}


def _base(world, which):
    """The input file's forward (computed once per module)."""
    if which not in _BASE:
        ins, sigma = _inputs(world)
        f = _runtime if which == "runtime" else _independent
        _BASE[which] = f(world["src"], ins, sigma)
    return _BASE[which]


def _rel(a, b):
    return max(float((x - y).norm() / y.norm()) for x, y in zip(a, b))


def test_fold_is_exact_in_the_runtime_and_an_independent_forward(world):
    tensors, _ = read_tensors(world["src"])
    factors = _random_factors(tensors, 0)
    out = _smoothed_file(world, "smoothed.safetensors", factors)
    with Checkpoint(out) as c:  # the file did change: weights scaled, norms divided
        w = c.read("blocks.1.mlp.fc2.weight").float()
        assert torch.equal(w, tensors["blocks.1.mlp.fc2.weight"].float() * factors[(1, "mlp.fc2")])
        assert not torch.equal(c.read("blocks.0.norm1.weight"), tensors["blocks.0.norm1.weight"])
    ins, sigma = _inputs(world)
    base = _base(world, "runtime")
    assert _rel(_runtime(out, ins, sigma), base) < 1e-5
    ind_base = _base(world, "independent")
    assert _rel(_independent(out, ins, sigma), ind_base) < 1e-5
    assert _rel(ind_base, base) < 1e-4  # the two forwards agree with each other


@pytest.mark.parametrize("where", ["shift_row_of_audio", "norm", "v_row", "up_row"])
def test_a_wrongly_folded_row_fails(world, where):
    tensors, _ = read_tensors(world["src"])
    factors = _random_factors(tensors, 1)
    hidden = tensors["blocks.0.norm1.weight"].shape[0]

    def spoil(t):  # undo the fold of one row (multiply back by its factor)
        if where == "shift_row_of_audio":  # modality 2, shift_mlp (chunk 3), channel 7
            r = 2 * 6 * hidden + 3 * hidden + 7
            s = factors[(1, "mlp.fc1")][7]
            t["blocks.1.adaln_proj.linear.weight"][r] *= s.to(torch.bfloat16)
            t["blocks.1.adaln_proj.linear.bias"][r] *= s.to(torch.bfloat16)
        elif where == "norm":
            t["blocks.0.norm1.weight"][3] *= factors[(0, "attn.qkv_proj")][3].to(torch.bfloat16)
        elif where == "v_row":
            n = t["blocks.0.attn.qkv_proj.weight"].shape[0]
            t["blocks.0.attn.qkv_proj.weight"][n - 5] *= \
                factors[(0, "attn.out_proj")][-5].to(torch.bfloat16)
        else:
            n = t["blocks.1.mlp.fc1.weight"].shape[0]
            t["blocks.1.mlp.fc1.weight"][n - 1] *= factors[(1, "mlp.fc2")][-1].to(torch.bfloat16)

    # make the spoiled row's factor far from 1 so its error shows
    key = {"shift_row_of_audio": ((1, "mlp.fc1"), 7), "norm": ((0, "attn.qkv_proj"), 3),
           "v_row": ((0, "attn.out_proj"), -5), "up_row": ((1, "mlp.fc2"), -1)}[where]
    factors[key[0]][key[1]] = 8.0
    out = _smoothed_file(world, f"spoiled_{where}.safetensors", factors, spoil)
    ins, sigma = _inputs(world)
    assert _rel(_runtime(out, ins, sigma), _base(world, "runtime")) > 1e-4
    if where == "shift_row_of_audio":  # the independent forward too (it is slow)
        assert _rel(_independent(out, ins, sigma), _base(world, "independent")) > 1e-4


def test_capture_records_channel_maxima_and_sampled_rows(world):
    from h3quant.calibration.capture import sample_indices
    from h3quant.pipelines.inputs_file import load_sigma, load_tensors
    from h3quant.runtime.model.model import H3Model

    seen = []
    with H3Model.open(world["src"], linear="reference") as m:
        block = m.load_block(1, torch.float32)
        block.fc1.register_forward_pre_hook(lambda mod, args: seen.append(args[0].clone()))
        for p in world["inputs"]:
            v, a, t = load_tensors(p, m.video_channels, m.audio_channels, m.text_dim)
            st = m.start(v, a, t, load_sigma(p))
            for i in m.blocks[:1]:
                st.x = m.load_block(i, torch.float32)(st.x, st.cond)
            block(st.x, st.cond)
    x = torch.cat(seen)
    with Statistics(world["stats"]) as s:
        assert s.meta["version"] == 3
        lay = s.layers["blocks.1.mlp.fc1"]
        assert lay.has_rows
        assert torch.allclose(lay.channel_absmax(), x.abs().amax(0), rtol=1e-5, atol=1e-6)
        idx = torch.tensor(sample_indices(x.shape[0]))
        assert torch.allclose(lay.sample(), x[idx], rtol=1e-5, atol=1e-6)
    assert len(idx) == min(256, x.shape[0]) and len(set(idx.tolist())) == len(idx)


def test_version_1_statistics_are_read_and_refused_for_smoothing(world):
    from h3quant.calibration.capture import BlockWriter, stats_layout
    from h3quant.errors import UsageError
    from h3quant.pipelines.convert import ConvertOptions, convert

    old = world["d"] / "v1.stats"
    with Statistics(world["stats"]) as s:
        meta = {k: v for k, v in s.meta.items() if k != "sample_rows"}
        meta["version"] = 1
        layers = {k: (lay.hessian().clone(), lay.channel_absmean().clone())
                  for k, lay in s.layers.items()}
    w = BlockWriter(old, stats_layout({k: h.shape[0] for k, (h, _) in layers.items()},
                                      {"h3quant.calibration": json.dumps(meta)}))
    for k, (h, am) in layers.items():
        w.write_tensor(f"{k}.hessian", h)
        w.write_tensor(f"{k}.absmean", am)
    w.close(True)
    with Statistics(old) as s:
        assert not s.layers["blocks.0.mlp.fc1"].has_rows
    with pytest.raises(UsageError, match="capture them again"):
        convert(world["src"], world["d"] / "never.safetensors",
                ConvertOptions(target="int4-convrot", calibration=str(old), smooth="auto"))
    assert not (world["d"] / "never.safetensors").exists()


def _layer_tensors(c, name):
    p = name + "."
    return {n[len(p):]: c.read(n) for n in c.tensors if n.startswith(p)}


@pytest.mark.slow
@pytest.mark.parametrize("target", ["int4-convrot", "w4a8"])
def test_convert_smooth_keys_markers_folds_and_kitchen(world, target):
    pytest.importorskip("comfy_kitchen.tensor")
    from h3quant.pipelines.convert import ConvertOptions, convert

    d = world["d"]
    cal, smo = d / f"{target}_cal.safetensors", d / f"{target}_smooth.safetensors"
    convert(world["src"], cal, ConvertOptions(target=target, calibration=str(world["stats"]),
                                              overwrite=True, report=False))
    rep = convert(world["src"], smo, ConvertOptions(
        target=target, calibration=str(world["stats"]), smooth="auto", overwrite=True))
    smoothed = [n for n, e in rep.extra["smoothing"].items() if e["smoothed"]]
    assert smoothed, rep.extra["smoothing"]
    src, _ = read_tensors(world["src"])
    with Checkpoint(cal) as a, Checkpoint(smo) as b:
        # ComfyUI's key set, dtypes, shapes, markers and marker table: unchanged
        assert {n: (i.dtype, i.shape) for n, i in a.tensors.items()} == \
            {n: (i.dtype, i.shape) for n, i in b.tensors.items()}
        for n in a.tensors:
            if n.endswith(".comfy_quant"):
                assert bytes(a.read_bytes(n)) == bytes(b.read_bytes(n)), n
        ma, mb = dict(a.metadata), dict(b.metadata)
        oa, ob = json.loads(ma.pop("h3quant.options")), json.loads(mb.pop("h3quant.options"))
        assert json.loads(mb.pop("h3quant.smoothing")) == sorted(smoothed)
        assert ma == mb and ob.get("smooth") == "auto" and "smooth" not in oa
        hidden = src["blocks.0.norm1.weight"].shape[0]
        got, s_of = {}, {}
        for name in smoothed:  # each factor read back from the file, a power of two
            p, lin = name[:name.index(".", len("blocks.")) + 1], name.split(".", 2)[2]
            w = src[name + ".weight"].float()
            t = _layer_tensors(b, name)
            got[name] = _kitchen_decode(target, t, w.shape)
            assert torch.allclose(got[name], _h3quant_decode(target, t), rtol=0,
                                  atol=1e-5 * float(got[name].abs().max()))
            if lin in smooth.NORM_OF:  # from the norm weight; the shift rows divided alike
                s = src[p + smooth.NORM_OF[lin]].float() / b.read(p + smooth.NORM_OF[lin]).float()
                ada_w, ada_b = (b.read(p + f"adaln_proj.linear.{x}").float()
                                for x in ("weight", "bias"))
                for r0, r1 in smooth.shift_rows(lin, hidden):
                    assert torch.equal(ada_w[r0:r1] * s[:, None],
                                       src[p + "adaln_proj.linear.weight"][r0:r1].float())
                    assert torch.equal(ada_b[r0:r1] * s,
                                       src[p + "adaln_proj.linear.bias"][r0:r1].float())
            else:  # from the stored weight: per column, the least-squares ratio to W
                s = (got[name] * w).sum(0) / (w * w).sum(0)
                s = torch.pow(2.0, torch.log2(s).round())
            assert torch.equal(torch.log2(s), torch.log2(s).round())
            s_of[name] = s
        with Statistics(world["stats"]) as st:
            for name in smoothed:  # what the stored layer computes on x / s is W x
                p, lin = name[:name.index(".", len("blocks.")) + 1], name.split(".", 2)[2]
                w = src[name + ".weight"].float().clone()
                nxt = {"attn.qkv_proj": "attn.out_proj", "mlp.fc1": "mlp.fc2"}.get(lin)
                if nxt is not None and p + nxt in s_of:  # its v / up rows hold that division
                    k = s_of[p + nxt].numel()
                    w[-k:] /= s_of[p + nxt][:, None]
                x = st.layer(name).sample()
                want = x @ w.t()
                have = (x / s_of[name]) @ got[name].t()
                rel = float((have - want).norm() / want.norm())
                assert rel < 0.25, (name, rel)  # a 4-bit layer of the smoothed weight
        # the tensors the fold does not touch are the input's
        for n in ("blocks.0.attn.q_norm.weight", "blocks.1.attn.k_norm.weight"):
            assert torch.equal(b.read(n), src[n])
        scale_rows = slice(hidden, 3 * hidden)  # scale_msa and gate_msa of modality 0
        assert torch.equal(b.read("blocks.0.adaln_proj.linear.weight")[scale_rows],
                           src["blocks.0.adaln_proj.linear.weight"][scale_rows])


def _h3quant_decode(target, t):
    if target == "int4-convrot":
        from h3quant.formats.int4_convrot.tensors import decode_int4_convrot

        return decode_int4_convrot(t["weight"].view(torch.int8), t["weight_scale"].reshape(-1))
    from h3quant.formats.w4a8.tensors import decode_w4a8

    return decode_w4a8(t)


def _kitchen_decode(target, t, shape):
    """The weight comfy-kitchen dequantizes from a layer's stored tensors (fp32)."""
    if target == "int4-convrot":
        from comfy_kitchen.tensor.convrot_w4a4 import dequantize_convrot_w4a4_weight

        return dequantize_convrot_w4a4_weight(t["weight"], t["weight_scale"], 256,
                                              output_dtype=torch.float32).float()
    from comfy_kitchen.tensor.base import QuantizedTensor
    from comfy_kitchen.tensor.w4a8_int8 import AsymW4A8Int8Layout

    lay = AsymW4A8Int8Layout.Params(scale=t["weight_s_rel"], s_channel=t["weight_s_channel"],
                                    codebook=t["weight_codebook"], orig_dtype=torch.float32,
                                    orig_shape=tuple(shape))
    return QuantizedTensor(t["weight"], "AsymW4A8Int8Layout", lay).dequantize().float()


def _target(name):
    from h3quant.formats import registry

    codec = registry.target_codec(name)
    return codec, codec.spec.planning.marker(registry.target(name), 256)


@pytest.mark.parametrize("name", ["w4a8", "int8-convrot", "int4-convrot"])
def test_runtime_output_is_the_runtimes_layer(name):
    """The search's activation path against the runtime's own linear for the same tensors."""
    from h3quant.runtime.linear import QuantizedLinear

    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(64, 512, generator=g), torch.randn(16, 512, generator=g) * 3
    codec, marker = _target(name)
    out = codec.encoder.encode(w, marker, "exact")
    got = smooth.runtime_output(codec, marker, out, x)
    if name == "int4-convrot":
        from h3quant.formats.int4_convrot.tensors import w4a4_linear

        want = w4a4_linear(x, out["weight"].view(torch.int8), out["weight_scale"], 256)
    else:
        q, s = codec.grid.int8_grid(out, marker)
        lin = QuantizedLinear.from_int8(q, s, convrot=True, group_size=256, device="cpu")
        want = lin(x)
    assert torch.allclose(got, want.float(), rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    y = x @ w.t()
    assert float((got - y).norm() / y.norm()) < 0.5  # and it is the layer, quantized


def test_choose_smooths_an_outlier_channel_and_leaves_flat_inputs():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(128, 512, generator=g)
    x = torch.randn(256, 512, generator=g)
    codec, marker = _target("int4-convrot")
    flat = smooth.choose(w, x.abs().amax(0), x, codec, marker)
    assert flat.s is None
    x[:, :4] *= 60.0  # four outlier channels
    c = smooth.choose_for_target(w, x.abs().amax(0), x, "int4-convrot")
    assert c.s is not None and bool((c.s[:4] > 1).all())
    assert c.modelled_db["smoothed"] > c.modelled_db["plain"] + smooth.MIN_GAIN_DB
    assert torch.equal(torch.log2(c.s), torch.log2(c.s).round())


@pytest.mark.slow
def test_smooth_composes_with_a_rule_and_a_lora(world):
    """--layer rule (another target for block 1) and --lora with --smooth auto: each layer is
    searched on its own target, the LoRA-merged weights are smoothed, the key set and markers
    are those of the same conversion without smoothing."""
    from click.testing import CliRunner

    from h3quant.cli import main

    d = world["d"]
    lora = d / "style.safetensors"
    r = CliRunner().invoke(main, ["synth-lora", str(lora), "--blocks", "2", "--seed", "5"])
    assert r.exit_code == 0, r.output
    common = ["--to", "int4-convrot", "--layer", r"blocks\.1\.=w4a8", "--lora", str(lora),
              "--calibration", str(world["stats"]), "--overwrite"]
    plain, smo, rep = d / "rl_plain.safetensors", d / "rl_smooth.safetensors", d / "rl.json"
    r = CliRunner().invoke(main, ["convert", str(world["src"]), str(plain), *common, "--no-report"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["convert", str(world["src"]), str(smo), *common,
                                  "--smooth", "auto", "--report", str(rep)])
    assert r.exit_code == 0, r.output
    entries = json.loads(rep.read_text())["smoothing"]
    assert {n.split(".")[1] for n, e in entries.items() if e["smoothed"]} == {"0", "1"}
    with Checkpoint(plain) as a, Checkpoint(smo) as b:
        assert {n: (i.dtype, i.shape) for n, i in a.tensors.items()} == \
            {n: (i.dtype, i.shape) for n, i in b.tensors.items()}
        assert b.read("blocks.1.attn.qkv_proj.comfy_quant").numel() > 0
        for n in a.tensors:
            if n.endswith(".comfy_quant"):
                assert bytes(a.read_bytes(n)) == bytes(b.read_bytes(n)), n
