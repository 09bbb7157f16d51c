"""A file that is not safetensors is described by what it is: a PyTorch pickle (torch.save's zip
archive or its older bare pickle), or a file named .gguf without the GGUF magic, never by a raw
header length. Files made here (torch.save, raw bytes)."""

from __future__ import annotations

import pytest
import torch
from helpers.forge import cli


def _zip(p):
    torch.save({"w": torch.zeros(3)}, p)


def _pickle(p):
    torch.save({"w": torch.zeros(3)}, p, _use_new_zipfile_serialization=False)


def _not_gguf(p):
    p.write_bytes(b"GGUX" + bytes(200))


def _html(p):  # an error page saved under a .gguf name
    p.write_bytes(b"<html>" + bytes(200))


CASES = [("model.pt", _zip, "zip archive"), ("model.ckpt", _pickle, "Python pickle"),
         ("model.pth", _pickle, "Python pickle"), ("h3.safetensors", _zip, "zip archive"),
         ("h3-Q8_0.gguf", _not_gguf, "not a GGUF file"), ("h3.gguf", _html, "not a GGUF file")]


@pytest.mark.parametrize("name,make,words", CASES)
@pytest.mark.parametrize("command", ["inspect", "validate", "convert"])
def test_a_foreign_file_is_named_for_what_it_is(tmp_path, name, make, words, command):
    p = tmp_path / name
    make(p)
    args = [command, p] + ([tmp_path / "o.safetensors"] if command == "convert" else [])
    res = cli(*args)
    assert res.exit_code in (1, 2) and "Traceback" not in res.output, res.output
    assert words in res.output and "header length" not in res.output, res.output
    assert not (tmp_path / "o.safetensors").exists()
