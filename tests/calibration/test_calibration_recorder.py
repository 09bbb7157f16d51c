"""The inputs recorder against a stand-in with ComfyUI's H3 call signature, and the node file."""

import importlib.util
import sys
import types

import pytest
import torch

from h3quant.calibration.recorder import InputsRecorder
from h3quant.pipelines.inputs_file import load_sigma, load_tensors, read_header


class StandIn:
    """ComfyUI's MiniMax H3 diffusion model signature: forward(x, timestep, context, ...)."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, timestep, context, transformer_options={}, minimax_payload=None,
                 denoise_mask=None, audio_denoise_mask=None, **kwargs):
        self.calls.append((timestep, transformer_options, minimax_payload))
        return [-x[0], -x[1]]


def _call(seed, batch=1, text=16):
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(batch, 24, 2, 8, 8, generator=g).to(torch.bfloat16)
    audio = torch.randn(batch, 32, 2, 12, generator=g)
    context = torch.randn(batch, text, 48, generator=g)
    return [video, audio], torch.tensor([1000.0 * (0.9 - 0.2 * seed)]), context


def test_wrap_records_every_call_and_passes_everything_through(tmp_path):
    model = StandIn()
    rec = InputsRecorder(tmp_path / "rec", max_calls=3)
    wrapped = rec.wrap(model)
    outs = []
    for s in range(4):
        x, t, c = _call(s)
        outs.append((x, wrapped(x, t, c, transformer_options={"k": s}, minimax_payload={"p": s})))
    assert len(model.calls) == 4 and model.calls[2][1] == {"k": 2} and model.calls[3][2] == {"p": 3}
    for x, y in outs:  # the model's outputs, untouched
        assert torch.equal(y[0], -x[0]) and torch.equal(y[1], -x[1])
    assert len(rec.files) == 3 and rec.stopped and "max_calls" in rec.stopped  # bounded
    for s, path in enumerate(rec.files):
        dims = read_header(path)
        assert dims == {"frames": 2, "height": 8, "width": 8, "audio_frames": 12, "text_tokens": 16}
        v, a, t = load_tensors(path, 24, 32, 48)
        x, ts, c = _call(s)
        assert torch.equal(v, x[0].float()) and torch.equal(a, x[1]) and torch.equal(t, c)
        assert load_sigma(path) == pytest.approx(float(ts) / 1000.0, rel=1e-6)


def test_bounded_in_bytes_and_skips_what_a_file_cannot_hold(tmp_path):
    one = sum(t.numel() * t.element_size() for t in (*_call(0)[0], _call(0)[2]))
    logs = []
    rec = InputsRecorder(tmp_path, max_bytes=2 * one + 10000, log=logs.append)
    model = rec.wrap(StandIn())
    model(*_call(0, batch=2))  # batch 2: ComfyUI's H3 runs batch 1; skipped
    for s in range(4):
        model(*_call(s))
    assert rec.skipped == 1 and len(rec.files) == 2 and "max_bytes" in rec.stopped
    assert sum(p.stat().st_size for p in rec.files) <= 2 * one + 10000
    assert any("skipped" in m for m in logs)


def test_diffusion_model_wrapper_runs_the_chain(tmp_path):
    rec = InputsRecorder(tmp_path)
    model = StandIn()
    x, t, c = _call(1)
    y = rec.diffusion_model_wrapper(model, x, t, c, {"opt": 1}, minimax_payload=None)
    assert torch.equal(y[0], -x[0]) and len(rec.files) == 1 and model.calls[0][1] == {"opt": 1}


def test_recorded_files_feed_capture(tmp_path):
    """h3quant's own model called through the recorder: its files are capture's inputs."""
    from h3quant.pipelines.capture import capture_statistics
    from h3quant.runtime.model.model import H3Model
    from h3quant.synth import synth_checkpoint

    src = tmp_path / "m.safetensors"
    synth_checkpoint(src, preset="tiny", blocks=1, seed=1)
    rec = InputsRecorder(tmp_path / "rec")
    with H3Model.open(src) as m:
        def comfy_like(x, timestep, context, **kw):  # ComfyUI's signature over h3quant's forward
            return m(x[0], x[1], context, float(timestep.flatten()[0]) / 1000.0)
        run = rec.wrap(comfy_like)
        g = torch.Generator().manual_seed(0)
        for sigma in (0.9, 0.5, 0.2):
            run([torch.randn(1, m.video_channels, 1, 8, 8, generator=g),
                 torch.randn(1, m.audio_channels, 2, 8, generator=g)],
                torch.tensor([1000.0 * sigma]), torch.randn(1, 8, m.text_dim, generator=g))
    res = capture_statistics(src, rec.files, tmp_path / "s.stats", predict=False)
    assert [round(i["sigma"], 5) for i in res.inputs] == [0.9, 0.5, 0.2]
    assert res.rows == 3 * (8 + 16 + 16)


class _Layout:  # ComfyUI's PackedLayout: an object the recorder cannot store
    signature = (16, 2, 8, 8, 12)


def _comfy_modules(monkeypatch, out):
    """Stand-ins for the two ComfyUI modules the node imports (its node API)."""
    ext = types.ModuleType("comfy.patcher_extension")
    ext.WrappersMP = types.SimpleNamespace(DIFFUSION_MODEL="diffusion_model")
    comfy = types.ModuleType("comfy")
    comfy.patcher_extension = ext
    fp = types.ModuleType("folder_paths")
    fp.get_output_directory = lambda: str(out)
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.patcher_extension", ext)
    monkeypatch.setitem(sys.modules, "folder_paths", fp)


def _load_custom_node(path):
    """What ComfyUI does with a file in custom_nodes: import it, read NODE_CLASS_MAPPINGS and
    check each class's node API (INPUT_TYPES, RETURN_TYPES, FUNCTION, CATEGORY)."""
    spec = importlib.util.spec_from_file_location("h3quant_nodes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    mappings = module.NODE_CLASS_MAPPINGS
    assert set(module.NODE_DISPLAY_NAME_MAPPINGS) <= set(mappings)
    for cls in mappings.values():
        required = cls.INPUT_TYPES()["required"]
        assert all(isinstance(v, tuple) and isinstance(v[0], (str, list)) for v in required.values())
        assert isinstance(cls.RETURN_TYPES, tuple) and isinstance(cls.CATEGORY, str)
        assert callable(getattr(cls(), cls.FUNCTION))
    return mappings


class Patcher:  # the two ModelPatcher methods the node uses, and clone
    def __init__(self):
        self.wrappers = {}

    def clone(self):
        c = Patcher()
        c.wrappers = {k: {kk: list(vv) for kk, vv in v.items()} for k, v in self.wrappers.items()}
        return c

    def add_wrapper_with_key(self, kind, key, fn):
        self.wrappers.setdefault(kind, {}).setdefault(key, []).append(fn)

    def remove_wrappers_with_key(self, kind, key):
        self.wrappers.get(kind, {}).pop(key, None)


def _run_chain(patched, *args, **kwargs):
    """ComfyUI's WrapperExecutor with one DIFFUSION_MODEL wrapper: wrapper(executor, ...)."""
    fns = [f for v in patched.wrappers.get("diffusion_model", {}).values() for f in v]
    model = StandIn()
    if not fns:
        return model(*args, **kwargs)
    assert len(fns) == 1
    return fns[0](model, *args, **kwargs)


def _comfy_call(seed):
    """One call as ComfyUI's H3 forward receives it (model.py: x, timestep, context,
    transformer_options, minimax_payload, denoise_mask, audio_denoise_mask, **kwargs)."""
    x, t, c = _call(seed)
    g = torch.Generator().manual_seed(100 + seed)
    opts = {"sample_sigmas": torch.tensor([1.0, 0.5, 0.0]), "minimax_h3_sigma_shift_video": 12.0,
            "minimax_h3_sigma_shift_audio": 3.0, "cond_or_uncond": [0], "block_index": 3,
            "patches": {"post": [lambda h: h]}, "minimax_h3_layout": _Layout()}
    payload = {"audio_scale": 1.0, "layout": _Layout(), "seed": 7,
               "cond_video_latents": [torch.randn(1, 24, 1, 8, 8, generator=g)],
               "cond_audio_latents": [], "visual_cond_noise_aug": 0.999,
               "text_token_tags": torch.randint(0, 3, (1, 16), generator=g),
               "_text_token_tags_list": [0] * 16, "keyframes": [{"index": 0, "strength": 1.0}]}
    mask = torch.rand(1, 1, 2, 8, 8, generator=g)
    return (x, t, c, opts), {"minimax_payload": payload, "denoise_mask": mask,
                             "audio_denoise_mask": None, "control": {"scale": 0.5}}


def _leaves(name, value):
    """Every (name, value) leaf of an argument, walked independently of the recorder."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(f"{name}.{k}", v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(f"{name}.{i}", v)
    else:
        yield name, value


def test_node_package_through_the_one_line_shim(tmp_path, monkeypatch):
    """The shim ComfyUI imports from custom_nodes loads h3quant.comfy; two runs of the node
    write two folders; every argument of a call is stored or named as dropped."""
    import json
    from pathlib import Path

    from h3quant.formats.container.reader import SafetensorsFile

    _comfy_modules(monkeypatch, tmp_path)
    shim = Path(__file__).resolve().parents[2] / "docs" / "examples" / "h3quant_recorder_node.py"
    assert len(shim.read_text().strip().splitlines()) == 1  # the one-line shim
    mappings = _load_custom_node(shim)
    node = mappings["H3QuantRecordInputs"]()
    base = Patcher()
    (patched,) = node.patch(base, "rec", 5, 1.0)
    (twice,) = node.patch(patched, "rec", 5, 1.0)
    assert base.wrappers == {}  # the sampler's own model is untouched
    assert len(twice.wrappers["diffusion_model"]["h3quant_record_inputs"]) == 1  # never stacks
    args, kwargs = _comfy_call(0)
    out = _run_chain(twice, *args, **kwargs)
    assert torch.equal(out[0], -args[0][0])
    _run_chain(twice, *_comfy_call(1)[0], **_comfy_call(1)[1])
    (again,) = node.patch(base, "rec", 5, 1.0)  # a second recording run
    _run_chain(again, *args, **kwargs)
    runs = sorted(p for p in (tmp_path / "rec").iterdir())
    assert len(runs) == 2 and all(p.name.startswith("run_") for p in runs)
    counts = sorted(len(list(p.glob("*.safetensors"))) for p in runs)
    assert counts == [1, 2]  # nothing overwritten: each run numbers its own files from 0
    first = sorted(runs, key=lambda p: -len(list(p.glob("*"))))[0] / "call_00000.safetensors"
    assert read_header(first)["text_tokens"] == 16  # still an inputs file for every command
    with SafetensorsFile(first, mmap=False) as fh:
        names = set(fh.tensors)
        meta = json.loads(fh.metadata["h3quant.call"])
        stored = {n: fh.read(fh.tensors[n]) for n in names if n.startswith("extra.")}
    dropped, values = meta["dropped"], meta["values"]
    every = list(_leaves("transformer_options", args[3]))
    for k, v in kwargs.items():
        every += list(_leaves(k, v))
    for name, v in every:
        if any(name == d or name.startswith(d + ".") for d in dropped):
            continue
        if isinstance(v, torch.Tensor):
            assert torch.equal(stored[f"extra.{name}"], v), name
        else:
            node_ = values
            for part in name.split("."):
                node_ = node_[int(part)] if isinstance(node_, list) else node_[part]
            assert node_ == v, name
    assert set(dropped) == {"transformer_options.patches", "transformer_options.minimax_h3_layout",
                            "minimax_payload.layout", "minimax_payload._text_token_tags_list"}


def test_run_folders_never_collide(tmp_path):
    """Recorders started in the same second get their own folders."""
    recs = [InputsRecorder(tmp_path) for _ in range(3)]
    for r in recs:
        r.record(*_call(0))
    assert len({r.run_dir for r in recs}) == 3 and all(len(r.files) == 1 for r in recs)
