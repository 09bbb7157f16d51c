"""The demo's log reads step by step when captured: each command line, then everything that step
printed (results and notes alike), on one stream, before the next command line."""

from __future__ import annotations

import re

from helpers.forge import cli

from h3quant.cli import demo_cmd


def test_demo_log_is_one_stream_in_step_order(tmp_path, monkeypatch):
    def quick_steps(root, preset, blocks, device):
        src = str(root / "h3_bf16.safetensors")
        return [["synth", src, "--preset", "tiny", "--blocks", "1", "--overwrite"],
                ["inspect", src], ["validate", src]]

    monkeypatch.setattr(demo_cmd, "_steps", quick_steps)
    res = cli("demo", "--dir", tmp_path / "demo")
    assert res.exit_code == 0, res.output
    assert res.stderr == "", res.stderr  # notes (synth's "wrote ...") joined the log on stdout
    parts = re.split(r"^\$ h3quant (\S+).*$", res.stdout, flags=re.M)
    steps = dict(zip(parts[1::2], parts[2::2]))
    assert list(steps) == ["synth", "inspect", "validate"], res.stdout
    assert "wrote " in steps["synth"]  # a note, printed to stderr by synth on its own
    assert "size " in steps["inspect"] and "wrote" not in steps["inspect"]  # inspect's table
    assert "all 3 steps passed" in steps["validate"]
