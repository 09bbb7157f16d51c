"""``h3quant inspect``: sizes, dtypes, formats, bits per weight and topology, from headers only."""

from __future__ import annotations

import click

from h3quant.cli.common import (
    CHECKPOINT,
    emit_json,
    format_table,
    guard,
    handle_errors,
    mmap_option,
)
from h3quant.sizes import size_text



def fmt_bpw(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def render(res) -> str:
    out = [f"checkpoint   {res.path}"]
    if res.index:
        out.append(f"index        {res.index}")
    nfiles = len(res.files)
    plural = "s" * (nfiles != 1)
    out.append(f"size         {size_text(res.total_bytes)} in {nfiles} file{plural}, "
               f"{res.tensor_count} tensors, {res.parameters:,} weights")
    lc = res.layer_counts
    out.append(f"layers       {lc['layers']} ({lc['quantized']} quantized), "
               f"{lc['other_tensors']} other tensors")
    bpw = res.bits_per_weight
    out.append(f"bits/weight  {fmt_bpw(bpw['all'])} overall, {fmt_bpw(bpw['quantized'])} in "
               "quantized layers")
    topo = res.topology
    out.append("topology     " + (_topology_line(topo) if topo else "not a recognised H3 DiT"))
    out.append("naming       " + _naming_line(res.naming))
    out.append("metadata     " + (", ".join(res.metadata_keys) or "(none)"))
    c = res.findings
    out.append(f"findings     {c['error']} errors, {c['warning']} warnings, {c['info']} notes"
               + (" (run `h3quant validate` for details)" if c["error"] or c["warning"] else ""))
    for n in res.notes:
        out.append(f"note         {n['code']} {n['name']}" + (f" {n['tensor']}:" if n["tensor"]
                                                              else ":") + f" {n['message']}")
    out.append(f"data read    {res.bytes_read:,} bytes (marker tensors only)")
    if nfiles > 1:
        out += ["", format_table(["file", "size"], [[f["path"], size_text(f["size"])]
                                                    for f in res.files], {1})]
    out += ["", format_table(["dtype", "tensors", "size"],
                             [[k, v["tensors"], size_text(v["bytes"])]
                              for k, v in res.dtypes.items()],
                             {1, 2})]
    if res.formats:
        out += ["", format_table(["format", "layers", "size"],
                                 [[k, v["layers"], size_text(v["bytes"])]
                                  for k, v in res.formats.items()], {1, 2})]
    if res.loads:
        import textwrap

        out += ["", "will it load, and where does it run fast (h3quant backends --profile all)"]
        out += [textwrap.fill(f"{fmt}: {text}", 100, initial_indent="  ",
                              subsequent_indent="    ") for fmt, text in res.loads.items()]
    if res.mix:
        from h3quant.cli.render import render_mix

        out += ["", render_mix(res.mix)]
    if res.layers is not None:
        rows = [[r["name"], r["format"], r["N"], r["K"], size_text(r["bytes"]),
                 fmt_bpw(r["bits_per_weight"]), r["source"] or "-", r.get("layout") or "-",
                 {True: "yes", False: "no (ND)"}.get(r.get("nz"), "-"),
                 " ".join(f"{s}:{d}" for s, d in r["dtypes"].items())] for r in res.layers]
        out += ["", format_table(["layer", "format", "N", "K", "size", "bpw", "marker", "layout",
                                  "NZ", "dtypes"], rows, {2, 3, 4, 5})]
    return "\n".join(out)


def _naming_line(n: dict) -> str:
    if n.get("error"):
        return f"unreadable: [{n['error']['code']}] {n['error']['message']}"
    from h3quant.h3 import layouts

    text = layouts.get(n["naming"]).title + f" ({n['evidence']})"
    if n["fp8_scaled"]:
        text += f", {n['fp8_scaled']} scaled fp8 weight(s)"
    if n["naming"] != layouts.TARGET or n["fp8_scaled"]:
        text += "; `convert` re-lays it out as ComfyUI's single file"
    return text


def _topology_line(topo: dict) -> str:
    keys = ("preset", "preset_name", "form", "blocks", "hidden")
    parts = [f"{k}={topo[k]}" for k in keys if k in topo and not isinstance(topo[k], (list, dict))]
    if topo.get("head_bank", 1) > 1:
        parts.append(f"head_bank={topo['head_bank']}")
    return "MiniMax H3 DiT" + (" (" + ", ".join(parts) + ")" if parts else "")


@click.command("inspect", epilog="""\b
Examples:
  h3quant inspect model.safetensors
  h3quant inspect model.safetensors --layers          # one row per layer
  h3quant inspect model.safetensors.index.json --json # sharded, machine-readable
  h3quant inspect shards_dir/ --no-mmap
  h3quant inspect my_lora.safetensors                 # a LoRA: style, rank, H3 layers""")
@click.argument("ckpt", type=CHECKPOINT)
@click.option("--layers", is_flag=True,
              help="Add a table with one row per layer: format, N, K, size, bits per weight, "
                   "marker source, tensor dtypes.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document (fixed top-level keys) instead of text tables.")
@mmap_option
@handle_errors
def command(ckpt: str, layers: bool, as_json: bool, no_mmap: bool) -> None:
    """Summarise a checkpoint from its safetensors headers, without reading tensor data.

    CKPT is a .safetensors file, a *.safetensors.index.json shard index, or a directory.
    Reports file sizes, tensor and dtype counts, quantization formats, bits per weight
    (8 x bytes of weights and scales / logical weight count) and the detected MiniMax H3
    topology. Only the tiny .comfy_quant marker tensors are read, and only for layers the
    header's _quantization_metadata does not describe. Use `h3quant validate` to check rules.
    Exit status: 0 summarised, 2 unreadable input or usage error.
    """
    from h3quant.pipelines.headers.inspect import inspect_checkpoint
    from h3quant.pipelines.headers.lora_inspect import inspect_lora, looks_like_lora, render_lora

    if looks_like_lora(ckpt):  # a LoRA file: its style, ranks and the H3 layers it touches
        info = guard("inspecting", inspect_lora, ckpt)
        emit_json(info) if as_json else click.echo(render_lora(info))
        return

    from h3quant.formats.gguf.reader import is_gguf

    if is_gguf(ckpt):  # a GGUF file: header, tensor types, bits per weight, H3 topology
        from h3quant.pipelines.headers.gguf import inspect_gguf

        info = guard("inspecting", inspect_gguf, ckpt)
        emit_json(info) if as_json else click.echo(render_inspect(info))
        return
    res = guard("inspecting", inspect_checkpoint, ckpt, mmap=not no_mmap, layers=layers)
    if as_json:
        emit_json(res.to_dict())
    else:
        click.echo(render(res))


def render_inspect(info: dict) -> str:
    lines = [f"{info['path']}: GGUF v{info['gguf_version']}, architecture "
             f"{info['architecture'] or '-'}, {size_text(info['total_bytes'])}, "
             f"{info['tensor_count']} tensors ({info['naming']})"]
    bpw = info["bits_per_weight"]
    lines.append(f"bits per weight: all {bpw['all']}, DiT block linears {bpw['block_linears']}")
    lines.append("types: " + ", ".join(f"{k} {v['tensors']} ({size_text(v['bytes'])})"
                                       for k, v in sorted(info["types"].items())))
    topo = info["topology"]
    if topo:
        parts = [f"{k}={topo[k]}" for k in ("preset", "form", "blocks", "hidden")
                 if topo.get(k) is not None]
        if topo.get("head_bank", 1) > 1:
            parts.append(f"head_bank={topo['head_bank']}")
        lines.append("MiniMax H3 DiT (" + ", ".join(parts) + ")")
    else:
        lines.append("not a MiniMax H3 DiT (no H3 topology under ComfyUI's names)")
    return "\n".join(lines)
