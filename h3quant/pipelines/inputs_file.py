"""Whole-model inputs read from a safetensors file instead of drawn from a seed.

``plan --inputs FILE`` and ``verify --model --inputs FILE`` take the same file, so the planner's
prediction and the measurement run on the very same latents. The file holds:

* ``video``: float ``[1, C_video, F, H, W]`` (the model's video latent channels);
* ``audio``: float ``[1, C_audio, 2, Ta]`` (stereo audio latents);
* ``text``: float ``[1, L, D_text]`` (text encoder states);
* ``sigma`` (optional): a one-element float in (0, 1], the noise level (else the command's).

Values are read as fp32 and must be finite. The sizes are held to the whole-model row limit
(``h3quant.limits``) from the header alone, before any tensor is read. Tensors named
``extra.*`` (what the ComfyUI recorder keeps beside them: condition latents, masks, text token
tags) are allowed and not read: h3quant's forward runs without them.

Every command's ``--inputs`` goes through ``expand_inputs``: a value is a file, a folder (its
``*.safetensors`` files) or a glob (``steps/*.safetensors``, expanded here because Windows
shells pass it unexpanded), and several values may follow one ``--inputs``. A folder is read
with its subfolders, so ``--inputs h3quant_inputs`` takes every run the recorder made there.
"""

from __future__ import annotations

import glob
import math
import os
from pathlib import Path

from h3quant.errors import UsageError

_SHAPES = {"video": 5, "audio": 4, "text": 3}
EXTRA = "extra."  # tensors kept beside the inputs (the recorder's), not read by the forward
MAX_INPUTS = 4096  # files one --inputs list may resolve to
_GLOB = set("*?[")


def _folder_files(folder: str) -> list[str]:
    """The folder's ``*.safetensors`` files and those of its subfolders (the recorder's run
    folders), sorted by their path inside it."""
    found = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        found += [os.path.join(root, n) for n in names
                  if n.endswith(".safetensors") and os.path.isfile(os.path.join(root, n))]
    return sorted(found, key=lambda p: os.path.relpath(p, folder).split(os.sep))


def expand_inputs(values, *, option: str = "--inputs") -> list[Path]:
    """The files that ``values`` name, in order: a file as itself, a folder as the
    ``*.safetensors`` files in it and its subfolders, sorted by path, a glob (``*``, ``?``, ``[...]``) as its matches
    sorted by name; a file named twice is kept once. UsageError for a value that names
    nothing, a folder or glob without a safetensors file, or more than ``MAX_INPUTS`` files."""
    out: list[Path] = []
    seen: set[str] = set()
    for value in values:
        text = os.fspath(value)
        if os.path.isfile(text):
            found = [text]
        elif os.path.isdir(text):
            found = _folder_files(text)
            if not found:
                raise UsageError(f"{option}: the folder holds no .safetensors file", path=text)
        elif _GLOB & set(text):
            found = sorted(p for p in glob.glob(text) if os.path.isfile(p))
            if not found:
                raise UsageError(f"{option}: the pattern matches no file", path=text)
        else:
            raise UsageError(f"{option}: no such file or folder", path=text)
        for p in found:
            key = os.path.realpath(p)
            if key not in seen:
                seen.add(key)
                out.append(Path(p))
        if len(out) > MAX_INPUTS:
            raise UsageError(f"{option}: more than {MAX_INPUTS} files; the limit is "
                             f"{MAX_INPUTS}", path=text)
    return out


def single_input(values, *, option: str = "--inputs") -> Path | None:
    """The one file ``values`` name (None for no value), for a command that runs one call;
    UsageError naming the files when they are several."""
    if not values:
        return None
    files = expand_inputs(values, option=option)
    if len(files) != 1:
        names = ", ".join(p.name for p in files[:3]) + (", ..." if len(files) > 3 else "")
        raise UsageError(f"{option}: this command runs one call and takes one inputs file; "
                         f"{len(files)} were given ({names})")
    return files[0]
_FLOATS = ("F32", "F16", "BF16", "F64")


def _fail(path, reason: str, tensor: str | None = None) -> UsageError:
    return UsageError(f"--inputs: {reason}", path=path, tensor=tensor)


def _open(path):
    from h3quant.errors import ContainerError
    from h3quant.formats.container.reader import SafetensorsFile

    try:
        return SafetensorsFile(path, mmap=False)
    except ContainerError as exc:
        raise _fail(path, exc.reason) from None


def read_header(path: str | os.PathLike) -> dict:
    """``{"frames", "height", "width", "audio_frames", "text_tokens"}`` from the file's header;
    UsageError naming the file and tensor when it is not a well-formed inputs file."""
    with _open(path) as fh:
        tensors = {n: (t.dtype, tuple(t.shape)) for n, t in fh.tensors.items()}
    for name, ndim in _SHAPES.items():
        if name not in tensors:
            raise _fail(path, f"no {name!r} tensor (the file needs video, audio and text)")
        dtype, shape = tensors[name]
        if dtype not in _FLOATS:
            raise _fail(path, f"{name} is {dtype}; a float tensor is needed", name)
        if len(shape) != ndim or shape[0] != 1 or 0 in shape:
            raise _fail(path, f"{name} has shape {list(shape)}; expected {ndim} dimensions "
                        "with batch 1 and no empty dimension", name)
    if tensors["audio"][1][2] != 2:
        raise _fail(path, f"audio has shape {list(tensors['audio'][1])}; dimension 2 must be 2 "
                    "(stereo)", "audio")
    extra = sorted(n for n in set(tensors) - set(_SHAPES) - {"sigma"}
                   if not n.startswith(EXTRA))
    if extra:
        raise _fail(path, f"unexpected tensor {extra[0]!r} (only video, audio, text, sigma "
                    f"and {EXTRA}*)",
                    extra[0])
    if "sigma" in tensors:
        dtype, shape = tensors["sigma"]
        if dtype not in _FLOATS or math.prod(shape) != 1:
            raise _fail(path, f"sigma is {dtype} {list(shape)}; one float value is needed",
                        "sigma")
    from h3quant.limits import MAX_MODEL_ROWS, model_rows

    _, _, f, h, w = tensors["video"][1]
    dims = {"frames": f, "height": h, "width": w, "audio_frames": tensors["audio"][1][3],
            "text_tokens": tensors["text"][1][1]}
    rows = model_rows(**dims)
    if rows > MAX_MODEL_ROWS:
        raise _fail(path, f"the latents make {rows:,} sequence rows (text + 2 x audio frames + "
                    f"frames x ceil(H/2) x ceil(W/2)); the limit is {MAX_MODEL_ROWS:,}")
    return dims


def _read(fh, name: str):
    return fh.read(fh.tensors[name]).float()


def load_tensors(path, video_channels: int, audio_channels: int, text_dim: int):
    """fp32 ``(video, audio, text)`` from the file, checked against the model's channels and
    finite; UsageError naming the tensor otherwise."""
    read_header(path)
    want = {"video": (1, video_channels), "audio": (1, audio_channels), "text": (2, text_dim)}
    got = {}
    with _open(path) as fh:
        for name, (dim, size) in want.items():  # every width from the header, before data
            shape = list(fh.tensors[name].shape)
            if shape[dim] != size:
                raise _fail(path, f"{name} has {shape[dim]} in dimension {dim}; the model "
                            f"takes {size} (shape {shape})", name)
        for name in want:
            t = _read(fh, name)
            if not bool(t.isfinite().all()):
                raise _fail(path, f"{name} holds non-finite values", name)
            got[name] = t.contiguous()
    return got["video"], got["audio"], got["text"]


def load_sigma(path) -> float | None:
    """The file's sigma, or None when it has none (UsageError when it is out of (0, 1])."""
    with _open(path) as fh:
        if "sigma" not in fh.tensors:
            return None
        value = float(fh.read(fh.tensors["sigma"]).double().reshape(-1)[0])  # as stored
    if not (0.0 < value <= 1.0):
        raise _fail(path, f"sigma is {value}; it must be in (0, 1]", "sigma")
    return value


__all__ = ["EXTRA", "MAX_INPUTS", "expand_inputs", "load_sigma", "load_tensors", "read_header",
           "single_input"]
