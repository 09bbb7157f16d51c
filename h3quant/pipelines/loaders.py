"""``validate --loader``: the acceptance rules other H3 loaders publish, applied to a file's
headers, so a publisher knows which engines take it (sources: docs/FORMATS.md 27).

- ``comfyui``: ComfyUI's own loader (``comfy/ops.py`` dispatches on the marker's format among
  the layouts ``comfy/quant_ops.py`` registers; it reads safetensors, not GGUF).
- ``vllm-omni``: the H3 INT8 ConvRot loader of vllm-omni (its pull request "MiniMax-H3: Support
  Comfy INT8 ConvRot checkpoints"): the published pruned W8A8 INT8 ConvRot file, loaded with its
  per-layer quantization metadata and validated fail-closed.
- ``comfyui-gguf``: ComfyUI-GGUF's ``loader.py``: ``general.architecture`` must be a listed
  image architecture; a file without it (``kv_count`` 0) is detected from its tensor names (H3 by
  ``adaln_t_table``, ``blocks.0.adaln_proj.linear.weight`` and ``blocks.0.attn.qkv_proj.weight``).

Header-only and torch-free, like validate without ``--deep``.
"""

from __future__ import annotations

from pathlib import Path

from h3quant.findings import Finding

LOADERS = ("comfyui", "vllm-omni", "comfyui-gguf")

# ComfyUI-GGUF's H3 detection keys (its tensor-name detection for files without metadata) and
# the architecture string its H3 support lists.
GGUF_H3_KEYS = ("adaln_t_table", "blocks.0.adaln_proj.linear.weight",
                "blocks.0.attn.qkv_proj.weight")
GGUF_H3_ARCH = "minimax_h3"


def load_lines(formats) -> dict[str, str]:
    """Per quantized format: will it load, and where does it run fast (the device profiles)."""
    from h3quant import device_profiles
    from h3quant.formats import registry

    out = {}
    for fmt in sorted(set(formats)):
        spec = registry.spec(fmt)
        if spec is not None and spec.quantized:
            out[fmt] = device_profiles.load_line(spec)
    return out


def loader_findings(path: str | Path, loader: str, *, formats: dict[str, str] | None = None,
                    fields: dict[str, dict] | None = None, form: str | None = None,
                    gguf: bool = False) -> list[Finding]:
    """What ``loader`` refuses in the file at ``path``: ``formats`` maps each quantized layer to
    its marker's format, ``fields`` to its marker fields, ``form`` is the H3 topology's form
    (``pruned`` / ``full``); ``gguf`` says the file is a GGUF (read here, header only)."""
    where = str(path)
    formats = formats or {}
    if loader == "comfyui":
        return _comfyui(where, formats, gguf)
    if loader == "vllm-omni":
        return _vllm_omni(where, formats, fields or {}, form, gguf)
    if loader == "comfyui-gguf":
        return _comfyui_gguf(path, gguf)
    raise ValueError(loader)


def _comfyui(where: str, formats: dict[str, str], gguf: bool) -> list[Finding]:
    from h3quant.formats import registry

    if gguf:
        return [Finding("L101", "ComfyUI's own loader reads safetensors; this GGUF file loads "
                        "through ComfyUI-GGUF (validate --loader comfyui-gguf)", file=where)]
    out = []
    for fmt in sorted(set(formats.values())):
        spec = registry.spec(fmt)
        if spec is None or spec.runtime.kitchen is None:
            first = next(n for n, f in formats.items() if f == fmt)
            why = spec.runtime.load_note if spec is not None and spec.runtime.load_note else (
                "a format ComfyUI does not register")
            out.append(Finding("L101", f"{fmt} layers: {why}", tensor=first,
                               file=where))
    return out


def _vllm_omni(where: str, formats: dict[str, str], fields: dict[str, dict], form: str | None,
               gguf: bool) -> list[Finding]:
    from h3quant.formats import registry

    if gguf:
        return [Finding("L111", "vllm-omni's H3 quantized loader reads the ComfyUI safetensors "
                        "file, not GGUF", file=where)]
    out = []
    int8 = _int8_name(registry)
    if not formats:
        out.append(Finding("L111", "no quantized layer: vllm-omni's H3 INT8 ConvRot loader "
                           "expects the W8A8 int8 ConvRot file (a BF16 file loads through its "
                           "float path)", file=where))
    for name, fmt in sorted(formats.items()):
        if fmt != int8:
            out.append(Finding("L111", f"{fmt} layer: vllm-omni's H3 loader takes int8 ConvRot "
                               f"layers only ({int8} with convrot)", tensor=name, file=where))
            break
        if not (fields.get(name) or {}).get("convrot"):
            out.append(Finding("L111", "int8 layer without ConvRot: vllm-omni's H3 loader takes "
                               "the W8A8 int8 ConvRot layout only", tensor=name, file=where))
            break
    if form is not None and form != "pruned":
        out.append(Finding("L112", f"the {form} form: vllm-omni's H3 INT8 loader was published "
                           "for the pruned form (AdaLN curve table); the full form is not "
                           "documented", file=where))
    return out


def _int8_name(registry) -> str | None:
    """The wire name of the canonical int8 format (the one an ``npu`` layout re-lays out)."""
    for spec in registry.specs():
        if spec.canonical:
            return spec.canonical
    return None


def _comfyui_gguf(path: str | Path, gguf: bool) -> list[Finding]:
    where = str(path)
    if not gguf:
        return [Finding("L121", "ComfyUI-GGUF loads GGUF files; this is a safetensors file "
                        "(validate --loader comfyui)", file=where)]
    from h3quant.formats.gguf.reader import GgufFile

    with GgufFile(path) as g:
        arch = g.architecture
        names = set(g.tensors)
    if arch is None:
        missing = [k for k in GGUF_H3_KEYS if k not in names]
        if missing:
            return [Finding("L121", "no general.architecture (kv_count 0): ComfyUI-GGUF detects "
                            f"H3 from its tensor names and misses {', '.join(missing)} (the "
                            "full form has no adaln_t_table)", file=where)]
        return []
    if arch != GGUF_H3_ARCH:
        return [Finding("L121", f"general.architecture is {arch!r}: ComfyUI-GGUF builds that "
                        f"model (or refuses an architecture it does not list), not H3 "
                        f"({GGUF_H3_ARCH!r})", file=where)]
    return [Finding("L122", f"declares {GGUF_H3_ARCH!r}: a ComfyUI-GGUF that lists it in "
                    "IMG_ARCH_LIST is needed (releases before its H3 support refuse it)",
                    file=where)]
