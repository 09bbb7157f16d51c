"""``--inputs``: files, folders and globs (quoted or not), several after one option, in every
command that reads it; and every documented command line with --inputs, run as written."""

import glob
import os
import re
import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from h3quant.cli import main
from h3quant.errors import UsageError
from h3quant.pipelines.inputs_file import expand_inputs, single_input

ROOT = Path(__file__).resolve().parents[2]


def _touch(d: Path, *names) -> list[Path]:
    out = []
    for n in names:
        p = d / n
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")
        out.append(p)
    return out


def _inputs_files(d: Path, *names) -> list[Path]:
    """Tiny well-formed inputs files (video, audio, text, sigma)."""
    import torch

    from h3quant.calibration.recorder import write_inputs

    out = []
    for n in names:
        p = d / n
        p.parent.mkdir(parents=True, exist_ok=True)
        write_inputs(p, torch.zeros(1, 4, 1, 2, 2), torch.zeros(1, 2, 2, 2), torch.zeros(1, 2, 8),
                     0.5)
        out.append(p)
    return out


def test_expand_files_folders_globs(tmp_path):
    a, b, c = _touch(tmp_path, "s/a.safetensors", "s/b.safetensors", "s/run_2/c.safetensors")
    _touch(tmp_path, "s/notes.txt")
    assert expand_inputs([a]) == [a]
    assert expand_inputs([tmp_path / "s"]) == [a, b, c]  # a folder with its run folders
    assert expand_inputs([str(tmp_path / "s" / "*.safetensors")]) == [a, b]
    assert expand_inputs([str(tmp_path / "s" / "[ab].safetensors"), a]) == [a, b]  # once each
    for bad, why in (([tmp_path / "none.safetensors"], "no such file"),
                     ([str(tmp_path / "*.bin")], "matches no file"),
                     ([tmp_path / "s" / "run_2" / "x"], "no such file")):
        with pytest.raises(UsageError, match=why):
            expand_inputs(bad)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no .safetensors"):
        expand_inputs([tmp_path / "empty"])
    assert single_input([str(tmp_path / "s" / "a.*")]) == a
    with pytest.raises(UsageError, match="takes one inputs file; 2 were given"):
        single_input([tmp_path / "s" / "a.safetensors", b])


def test_many_values_after_one_option():
    from h3quant.cli.inputs_option import inputs_option

    @click.command()
    @click.argument("ckpt")
    @inputs_option(help="x")
    @click.option("--out")
    def cmd(ckpt, inputs, out):
        click.echo(repr((ckpt, inputs, out)))

    r = CliRunner().invoke(cmd, ["c", "--inputs", "a", "b", "--out", "o", "--inputs", "d"])
    assert r.exit_code == 0 and r.output.strip() == repr(("c", ("a", "b", "d"), "o"))
    r = CliRunner().invoke(cmd, ["c", "--inputs", "a", "b"])
    assert r.exit_code == 0 and r.output.strip() == repr(("c", ("a", "b"), None))


# ---------------------------------------------------------------- documented command lines

def _documented_lines() -> list[tuple[str, str]]:
    """(where, line) for every 'h3quant ...' command line with --inputs in docs/*.md, the
    README, the node shim and every command's --help (continuation lines joined)."""
    texts = [(p.name, p.read_text()) for p in sorted((ROOT / "docs").glob("*.md"))]
    texts.append(("README.md", (ROOT / "README.md").read_text()))
    for cmd in ("capture", "convert", "plan", "verify", "compare"):
        r = CliRunner().invoke(main, [cmd, "--help"], terminal_width=200)
        assert r.exit_code == 0, r.output
        texts.append((f"{cmd} --help", r.output))
    out = []
    for where, text in texts:
        text = re.sub(r"\\\s*\n\s*", " ", text)
        for m in re.finditer(r"(?<![\w/-])h3quant (capture|convert|plan|verify|compare)\b[^\n`|]*",
                             text):
            line = m.group(0).split("#")[0].split(" > ")[0].strip()  # no comment, no redirect
            if "--inputs" in line or "--calibrate-on" in line:
                out.append((where, line))
    return out


def test_the_documented_lines_are_found():
    lines = _documented_lines()
    wheres = {w for w, _ in lines}
    assert {"calibration.md", "capture --help", "convert --help"} <= wheres, lines
    assert sum("capture" in ln for _, ln in lines) >= 5


_CONSUMING = {"--out", "--to", "--through", "--device", "--calibration", "--reference", "--steps",
              "--sigma", "--group-size", "--json-out", "--report", "--recipe", "--preset",
              "--blocks", "--smooth", "--target-sqnr", "--max-size", "--seed", "--frames",
              "--feedback"}


def _files_of(args: list[str]) -> tuple[list[str], list[str]]:
    """(the checkpoints, the --inputs words) a documented line names."""
    ckpts, ins, i = [], [], 0
    while i < len(args):
        a = args[i]
        if a in ("--inputs", "--calibrate-on"):
            i += 1
            while i < len(args) and not args[i].startswith("-"):
                ins.append(args[i])
                i += 1
            continue
        if a in ("--through", "--reference"):
            ckpts.append(args[i + 1])
        if a in _CONSUMING:
            i += 2
            continue
        if not a.startswith("-") and a.endswith(".safetensors"):
            ckpts.append(a)
        i += 1
    return ckpts, ins


@pytest.mark.parametrize("shell", ["posix", "windows"])
def test_every_documented_inputs_line_parses_and_reads_its_files(tmp_path, monkeypatch, shell):
    """Each documented line as a POSIX shell passes it (globs expanded) and as a Windows shell
    does (globs left to h3quant): the command reads exactly the files the line names. The
    pipeline is stood in for (the runs themselves are tested elsewhere); what is checked is
    the command line, its --inputs list and the files it resolves to."""
    import h3quant.pipelines.capture as capture_mod
    import h3quant.pipelines.compare.run as compare_run
    import h3quant.pipelines.convert as convert_mod

    seen: dict = {}

    class Stop(BaseException):  # past the CLI's error handling: the pipeline was reached
        pass

    def fake_capture(ckpt, inputs, out, **kw):
        seen["inputs"] = expand_inputs(inputs)
        raise Stop

    def fake_compare(files, *, options=None, **kw):
        seen["inputs"] = [Path(options.inputs.file)]
        raise Stop

    def fake_convert(src, dst, options, **kw):
        seen["inputs"] = expand_inputs(options.calibrate_on)
        raise Stop

    monkeypatch.setattr(capture_mod, "capture_statistics", fake_capture)
    monkeypatch.setattr(compare_run, "compare_files", fake_compare)
    monkeypatch.setattr(convert_mod, "convert", fake_convert)
    lines = _documented_lines()
    for idx, (where, line) in enumerate(lines):
        here = tmp_path / f"line{idx}"  # each line in its own folder: no files of another line
        here.mkdir()
        monkeypatch.chdir(here)
        args = shlex.split(line)[1:]
        ckpts, ins = _files_of(args)
        want = []
        for word in ins:
            stem = word.replace("*", "x").rstrip("/")
            if any(ch in word for ch in "*?["):  # a glob: three files it matches, one it does not
                want += _inputs_files(here, *(stem.replace("x", n, 1) for n in ("0", "1", "2")))
                _touch(here, stem.replace("x", "0", 1) + ".txt")
            elif "." not in os.path.basename(stem):  # a folder
                want += _inputs_files(here, f"{stem}/a.safetensors", f"{stem}/b.safetensors")
            else:
                want += _inputs_files(here, stem)
        for c in ckpts:
            if not (here / c).exists():
                _touch(here, c)
        if shell == "posix":
            args = [x for a in args for x in (sorted(glob.glob(a)) if any(ch in a for ch in "*?[")
                                                and glob.glob(a) else [a])]
        seen.clear()
        try:
            r = CliRunner().invoke(main, args, catch_exceptions=True)
        except Stop:
            r = None
        if r is not None and "--device cuda" in line and r.exit_code == 2 and "cuda" in r.output:
            continue  # this machine has no such device: refused before the inputs are read
        assert r is None, (where, line, r.output)
        got = sorted(os.path.realpath(p) for p in seen["inputs"])
        assert got == sorted(os.path.realpath(p) for p in want), (where, line)
        for p in want:  # a fresh tree for the next line
            p.unlink()
