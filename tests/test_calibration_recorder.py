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


def test_node_file_installs_the_wrapper(tmp_path, monkeypatch):
    ext = types.ModuleType("comfy.patcher_extension")
    ext.WrappersMP = types.SimpleNamespace(DIFFUSION_MODEL="diffusion_model")
    comfy = types.ModuleType("comfy")
    comfy.patcher_extension = ext
    fp = types.ModuleType("folder_paths")
    fp.get_output_directory = lambda: str(tmp_path)
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.patcher_extension", ext)
    monkeypatch.setitem(sys.modules, "folder_paths", fp)
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "docs" / "examples" / "h3quant_recorder_node.py"
    spec = importlib.util.spec_from_file_location("h3quant_recorder_node", path)
    node = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(node)

    class Patcher:  # the two ModelPatcher methods the node uses
        def __init__(self):
            self.wrappers = {}

        def clone(self):
            c = Patcher()
            c.wrappers = {k: dict(v) for k, v in self.wrappers.items()}
            return c

        def add_wrapper_with_key(self, kind, key, fn):
            self.wrappers.setdefault(kind, {}).setdefault(key, []).append(fn)

        def remove_wrappers_with_key(self, kind, key):
            self.wrappers.get(kind, {}).pop(key, None)

    base = Patcher()
    (patched,) = node.H3QuantRecordInputs().patch(base, "rec", 5, 1.0)
    (twice,) = node.H3QuantRecordInputs().patch(patched, "rec", 5, 1.0)
    assert base.wrappers == {}
    fns = twice.wrappers["diffusion_model"][node.WRAPPER_KEY]
    assert len(fns) == 1  # re-applying replaces, never stacks
    x, t, c = _call(0)
    fns[0](StandIn(), x, t, c, {})
    assert len(list((tmp_path / "rec").glob("*.safetensors"))) == 1
