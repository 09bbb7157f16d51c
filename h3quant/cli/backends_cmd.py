"""``h3quant backends``: which int8 linear backends can run on a device, and why not."""

from __future__ import annotations

import click

from h3quant.cli.common import device_callback, emit_json, format_table, handle_errors
from h3quant.device_kinds import device_help

_HELP = """List the runtime's int8 linear backends with their availability on a device and, for
each unavailable one, every reason (missing device, missing op in this torch, missing package).

\b
Backends: reference (fp32 dequantized weight, the specification; only on request), torch-int8
(aten::_int_mm), npu (torch_npu.npu_dynamic_quant + npu_quant_matmul), dequant (dequantize on
the device, plain matmul), kitchen (comfy-kitchen's CUDA kernels). The first available one in
the device's preference order runs each int8 layer (see `h3quant verify`, which shows it per
layer). The per-format table says what runs each format's layers: fp8 and mxfp8 layers are
dequantized to the compute dtype and run as a float matmul, as ComfyUI does where it has no
kernel for them (it has fp8 kernels on CUDA sm_89+, mxfp8 on sm_100+). INT4 ConvRot
(convrot_w4a4) layers run "emulated" on the CPU, MPS and XPU: ComfyUI's forward there
(comfy-kitchen's eager path) quantizes the activations to int4 too, and h3quant runs the same.

\b
Exit status: 0 listed, 2 bad device string.

\b
Examples:
  h3quant backends                  # the device `auto` resolves to
  h3quant backends --device mps
  h3quant backends --device npu --json
"""


def backend_rows(device: str, probe=None) -> tuple[str, list[dict]]:
    """(resolved device, [{name, available, reason, reasons, summary, preferred}])."""
    from h3quant.runtime.backends import PREFERENCE, list_backends
    from h3quant.runtime.devices import parse_device

    dev = parse_device(device, probe=probe)
    order = PREFERENCE.get(dev.kind, ())
    rows = []
    for st in list_backends(dev, probe):
        rows.append({"name": st.name, "available": st.available, "reason": st.reason,
                     "reasons": list(st.reasons), "summary": st.summary,
                     "preference": order.index(st.name) + 1 if st.name in order else None})
    return str(dev), rows


def format_rows(device: str, probe=None) -> list[dict]:
    """Per quantized format: {format, runs, comfyui, reason} on ``device``."""
    from h3quant.runtime.decoded import format_routes

    return [{"format": r.format, "runs": r.runs, "comfyui": r.comfy, "reason": r.reason}
            for r in format_routes(device, probe)]


@click.command("backends", help=_HELP, context_settings={"max_content_width": 100})
@click.option("--device", default="auto", show_default=True, callback=device_callback(False),
              help=f"{device_help()}.")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON on stdout.")
@handle_errors
def command(device, as_json):
    dev, rows = backend_rows(device)
    if as_json:
        emit_json({"device": dev, "backends": rows, "formats": format_rows(device)})
        return
    click.echo(f"device {dev}")
    table = [[r["name"], "yes" if r["available"] else "no",
              "-" if r["preference"] is None else r["preference"], r["reason"]] for r in rows]
    click.echo(format_table(["backend", "available", "order", "reason"], table))
    ranked = sorted((r for r in rows if r["available"] and r["preference"]),
                    key=lambda r: r["preference"])
    click.echo("\nlayers run on: " + (f"{ranked[0]['name']} (first available in order; a layer "
                                        "its kernel refuses runs dequant)" if ranked
                                        else "nothing: no backend is available on this device"))
    fmts = format_rows(device)
    click.echo("\nper format")
    click.echo(format_table(["format", "h3quant runs", "ComfyUI runs", "why"],
                            [[r["format"], r["runs"], r["comfyui"], r["reason"]] for r in fmts]))
