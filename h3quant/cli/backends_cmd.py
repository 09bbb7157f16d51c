"""``h3quant backends``: which int8 linear backends can run on a device, and why not; per format,
what runs it there in h3quant and in ComfyUI (from the device profiles)."""

from __future__ import annotations

import textwrap

import click

from h3quant import device_profiles
from h3quant.cli.common import device_callback, emit_json, format_table, handle_errors
from h3quant.device_kinds import device_help

WIDTH = 100

_HELP = f"""List the runtime's int8 linear backends with their availability on a device and, for
each unavailable one, every reason (missing device, missing op in this torch, missing package);
then, per format, what runs its layers there in h3quant and what ComfyUI runs on that class of
device (native kernel, dequantized, emulated, refused).

\b
Backends: reference (fp32 dequantized weight, the specification; only on request), torch-int8
(aten::_int_mm), npu (torch_npu.npu_dynamic_quant + npu_quant_matmul), dequant (dequantize on
the device, plain matmul), kitchen (comfy-kitchen's CUDA kernels). The first available one in
the device's preference order runs each int8 layer (see `h3quant verify`, which shows it per
layer).

\b
ComfyUI runs a layer on its comfy-kitchen kernel when the layout's minimum CUDA capability is
met; elsewhere it dequantizes the weight: slower, more memory. --profile CLASS prints that table
for a device class without the device ({", ".join(device_profiles.names())});
--profile all prints every class.

\b
Exit status: 0 listed, 2 bad device string or class.

\b
Examples:
  h3quant backends                  # the device `auto` resolves to
  h3quant backends --device mps
  h3quant backends --device npu --json
  h3quant backends --profile ada    # an RTX 40xx, without one
  h3quant backends --profile all
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


def device_class_of(device: str, probe=None) -> device_profiles.DeviceClass | None:
    """The device class of a device string on this machine (a CUDA device's by its capability;
    None when that is unknown)."""
    from h3quant.runtime.capabilities import live_probe
    from h3quant.runtime.devices import parse_device

    probe = probe or live_probe()
    dev = parse_device(device, probe=probe)
    return device_profiles.for_device(dev.kind, lambda: probe.cuda_capability(dev.index))


def format_rows(device: str, probe=None, *, runs_here: bool = True) -> list[dict]:
    """Per quantized format: {format, runs, comfyui, reason, comfyui_class} on ``device``;
    ``runs`` is None when no backend is available on it (nothing runs there)."""
    from h3quant.formats import registry
    from h3quant.runtime.decoded import format_routes

    cls = device_class_of(device, probe)
    out = []
    for r in format_routes(device, probe):
        spec = registry.spec(r.format)
        out.append({"format": r.format, "runs": r.runs if runs_here else None,
                    "comfyui": device_profiles.cell(spec, cls) if cls else "unknown",
                    "comfyui_class": cls.name if cls else None,
                    "reason": r.reason if runs_here else "no backend is available on this device",
                    "note": device_profiles.note(spec, cls) if cls else None})
    return out


def profile_rows(names: list[str]) -> list[dict]:
    """Per quantized format: its cell in each named class, and its load line."""
    from h3quant.formats import registry

    classes = [device_profiles.device_class(n) for n in names]
    rows = []
    for spec in registry.specs():
        if not spec.quantized:
            continue
        rows.append({"format": spec.name, "load": device_profiles.load_line(spec),
                     "classes": {c.name: device_profiles.cell(spec, c) for c in classes},
                     "notes": {c.name: device_profiles.note(spec, c) for c in classes
                               if device_profiles.note(spec, c)}})
    return rows


# the matrix's cells, short enough for nine classes in 100 columns
_SHORT = {"native": "fast", "dequant": "deq", "emulated": "emu", "unverified": "?",
          "refused": "no"}


def wrapped(text: str, indent: str = "  ") -> str:
    return textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")


def _wrapped_table(head: list[str], rows: list[list]) -> str:
    """A table whose last column wraps onto continuation lines within WIDTH columns."""
    lines = format_table(head[:-1] + [""], [r[:-1] + [""] for r in rows]).splitlines()
    at = len(format_table(head[:-1], [r[:-1] for r in rows]).splitlines()[0]) + 2
    room = max(30, WIDTH - at)
    out = [lines[0].rstrip().ljust(at) + head[-1], lines[1].rstrip() + "  " + "-" * room]
    for line, r in zip(lines[2:], rows):
        parts = textwrap.wrap(str(r[-1]), room) or [""]
        out.append(line.rstrip().ljust(at) + parts[0])
        out += [" " * at + p for p in parts[1:]]
    return "\n".join(out)


def _profile(name: str, as_json: bool) -> None:
    names = list(device_profiles.names()) if name == "all" else [name]
    rows = profile_rows(names)
    if as_json:
        emit_json({"classes": [{"name": c.name, "label": c.label, "kind": c.kind,
                                "sm": list(c.sm) if c.sm else None}
                               for c in map(device_profiles.device_class, names)],
                   "formats": rows})
        return
    if len(names) == 1:
        cls = device_profiles.device_class(name)
        click.echo(f"device class {cls.name}: {cls.label}")
        click.echo(format_table(["format", "ComfyUI runs"],
                                [[r["format"], r["classes"][cls.name]] for r in rows]))
    else:
        click.echo(format_table(["format"] + names,
                                [[r["format"]] + [_SHORT[r["classes"][n]] for n in names]
                                 for r in rows]))
        click.echo(wrapped("fast: native kernel; deq: dequantized (slower, more memory); emu: "
                           "emulated; ?: unverified; no: ComfyUI refuses the file", ""))
        click.echo("\nclasses")
        for c in map(device_profiles.device_class, names):
            click.echo(wrapped(f"{c.name}: {c.label}"))
    click.echo("\nwill it load, and where does it run fast")
    for r in rows:
        click.echo(wrapped(f"{r['format']}: {r['load']}"))
        by_text: dict[str, list[str]] = {}
        for where, text in r["notes"].items():
            by_text.setdefault(text, []).append(where)
        for text, where in by_text.items():
            click.echo(wrapped(f"on {', '.join(where)}: {text}", "    "))


@click.command("backends", help=_HELP, context_settings={"max_content_width": WIDTH})
@click.option("--device", default="auto", show_default=True, callback=device_callback(False),
              help=f"{device_help()}.")
@click.option("--profile", "profile", default=None, metavar="CLASS",
              help="Print what ComfyUI runs natively on a device class instead of probing a "
                   f"device: {', '.join(device_profiles.names())} or all.")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON on stdout.")
@handle_errors
def command(device, profile, as_json):
    if profile is not None:
        if profile.strip().lower() != "all":
            device_profiles.device_class(profile)  # a bad class is a usage error (exit 2)
        _profile(profile.strip().lower(), as_json)
        return
    dev, rows = backend_rows(device)
    ranked = sorted((r for r in rows if r["available"] and r["preference"]),
                    key=lambda r: r["preference"])
    fmts = format_rows(device, runs_here=bool(ranked))
    if as_json:
        emit_json({"device": dev, "backends": rows, "formats": fmts})
        return
    cls = device_class_of(device)
    click.echo(f"device {dev}" + (f" (class {cls.name}: {cls.label})" if cls else ""))
    head = ["backend", "available", "order"]
    table = [[r["name"], "yes" if r["available"] else "no",
              "-" if r["preference"] is None else r["preference"]] for r in rows]
    click.echo(_wrapped_table(head + ["reason"],
                              [t + [r["reason"]] for t, r in zip(table, rows)]))
    click.echo("\nlayers run on: " + (f"{ranked[0]['name']} (first available in order; a layer "
                                        "its kernel refuses runs dequant)" if ranked
                                        else "nothing: no backend is available on this device, "
                                        "so h3quant runs no format here"))
    where = f"ComfyUI on {cls.name}" if cls else "ComfyUI"
    click.echo("\nper format")
    click.echo(format_table(["format", "h3quant runs", where],
                            [[r["format"], r["runs"] or "-", r["comfyui"]] for r in fmts]))
    if cls is None:
        click.echo(wrapped("ComfyUI: the device class is unknown here (no CUDA capability); "
                           "`h3quant backends --profile all` shows every class", ""))
    for r in fmts:
        if r["note"]:
            click.echo(wrapped(f"{r['format']}: {r['note']}", ""))
    if ranked:
        click.echo("\nwhy")
        for r in fmts:
            click.echo(wrapped(f"{r['format']}: {r['reason']}", ""))
