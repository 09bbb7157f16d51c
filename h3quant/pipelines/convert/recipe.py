"""Per-layer recipes for ``convert``: ``--layer REGEX=FORMAT`` rules and ``--recipe FILE.json``.

A rule names layers by a regular expression (``re.search`` on the layer name, as
``--include``) and gives them a format: one of the ``--to`` targets, with options
(``int8-convrot:g=64``, ``int8:layout=npu``), or ``keep`` (the layer is written as it is in
the input). Rules are tried in order and the first match wins; a layer no rule matches gets
``--to``. ``--layer`` rules come before the rules of a ``--recipe`` file.

A recipe file is JSON::

    {"rules": [{"layer": "blocks\\\\.(0|1)\\\\.", "format": "int8-convrot"},
               {"layer": "blocks\\\\.\\\\d+\\\\.attn\\\\.", "format": "int8-convrot", "g": 64},
               {"layer": ".", "format": "w4a8"}]}

(a bare list of rules is accepted too; other top-level keys are free-form notes, e.g. what the
planner predicted). Nothing here reads tensor data; ``check_rules`` holds the checks made
against the layers of a file before any work (see docs/FORMATS.md, "Recipes").
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from h3quant.errors import ConvertError, UsageError
from h3quant.formats import registry

KEEP = "keep"
LAYOUT_CHOICES = ("canonical", "npu")
_OPTION_NAMES = {"g": "group_size", "group_size": "group_size", "layout": "layout",
                 "linear": "linear_dtype", "linear_dtype": "linear_dtype"}
RULE_KEYS = frozenset({"layer", "format", "g", "group_size", "layout", "linear", "linear_dtype"})
LINEAR_DTYPES = ("int4", "int8")


def format_names() -> tuple[str, ...]:
    """What a rule's FORMAT may name: the ``--to`` targets and ``keep``."""
    return (*registry.targets(), KEEP)


@dataclass(frozen=True)
class Rule:
    """One rule: layers matching ``pattern`` are written as ``target`` (None: ``keep``)."""

    pattern: str
    target: str | None
    group_size: int | None = None  # None: the command's --group-size
    layout: str | None = None  # None: the command's --layout
    linear_dtype: str | None = None  # INT4 ConvRot: the activations ComfyUI's kernel multiplies
    # built by h3quant itself (--lora-promote's list of layer names): matched by ``re``
    internal: bool = field(default=False, compare=False)

    @property
    def format(self) -> str:
        """The FORMAT text: ``w4a8``, ``int8-convrot:g=64``, ``keep``."""
        opts = []
        if self.group_size is not None:
            opts.append(f"g={self.group_size}")
        if self.layout is not None:
            opts.append(f"layout={self.layout}")
        if self.linear_dtype is not None:
            opts.append(f"linear={self.linear_dtype}")
        return (self.target or KEEP) + (":" + ",".join(opts) if opts else "")

    @property
    def text(self) -> str:
        return f"{self.pattern}={self.format}"

    def to_dict(self) -> dict:
        d: dict = {"layer": self.pattern, "format": self.target or KEEP}
        if self.group_size is not None:
            d["g"] = self.group_size
        if self.layout is not None:
            d["layout"] = self.layout
        if self.linear_dtype is not None:
            d["linear"] = self.linear_dtype
        return d


def _check_pattern(pattern: str, where: str) -> None:
    from h3quant.patterns import compile_pattern

    compile_pattern(pattern, where, ConvertError)  # bounded matching time, or refused


def _option_value(key: str, value, where: str):
    if key == "group_size":
        from h3quant.convrot import is_valid_group_size

        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) \
                or not is_valid_group_size(value) or value > 1024:
            raise ConvertError(f"{where}: group size must be a power of 4 in 4..1024 "
                               f"(4, 16, 64, 256, 1024), got {value!r}")
        return value
    if key == "linear_dtype":
        if value not in LINEAR_DTYPES:
            raise ConvertError(f"{where}: linear must be int4 or int8 (the activations INT4 "
                               f"ConvRot's kernel multiplies), got {value!r}")
        return value
    if value not in LAYOUT_CHOICES:
        raise ConvertError(f"{where}: layout must be one of {', '.join(LAYOUT_CHOICES)}, "
                           f"got {value!r}")
    return value


def parse_format(text: str, where: str = "format") -> tuple[str | None, dict]:
    """``NAME[:opt=value,...]`` -> (target or None for keep, {"group_size": .., "layout": ..})."""
    name, _, rest = str(text).partition(":")
    if name not in format_names():
        raise ConvertError(f"{where}: unknown format {name!r} (choose from "
                           f"{', '.join(format_names())}; options as in int8-convrot:g=64)")
    opts: dict = {}
    for item in filter(None, rest.split(",")) if rest else ():
        key, eq, value = item.partition("=")
        if not eq or key not in _OPTION_NAMES:
            raise ConvertError(f"{where}: unknown format option {item!r} (options: g=N, "
                               f"layout={'|'.join(LAYOUT_CHOICES)}, linear=int4|int8)")
        opts[_OPTION_NAMES[key]] = _option_value(_OPTION_NAMES[key], value, where)
    if name == KEEP and opts:
        raise ConvertError(f"{where}: keep takes no options, got {rest!r}")
    return (None if name == KEEP else name), opts


def make_rule(pattern: str, target: str | None, opts: dict, where: str) -> Rule:
    _check_pattern(pattern, where)
    rule = Rule(pattern, target, opts.get("group_size"), opts.get("layout"),
                opts.get("linear_dtype"))
    if target is not None:
        codec = registry.target_codec(target)
        if rule.linear_dtype is not None and codec.spec.planning.with_linear_dtype(
                {"format": codec.spec.name}, rule.linear_dtype) is None:
            raise ConvertError(f"{where}: {target} has no activation choice; linear= applies "
                               "to int4-convrot only")
        if rule.layout is not None and registry.with_layout(codec, rule.layout) is None:
            raise ConvertError(f"{where}: layout {rule.layout} is not available for {target} "
                               f"(it has {', '.join(registry.layouts_of(codec))})")
        if rule.group_size is not None and not (registry.target(target).convrot
                                                or codec.spec.storage.always_convrot):
            raise ConvertError(f"{where}: {target} has no rotation; g= does not apply")
    return rule


def parse_rule(text: str) -> Rule:
    """``REGEX=FORMAT`` (the FORMAT is the text after the first ``=`` that starts a format name,
    so a pattern may itself contain ``=``)."""
    where = f"--layer {text!r}"
    names = format_names()
    for m in re.finditer("=", text):
        pattern, fmt = text[:m.start()], text[m.end():]
        if fmt.partition(":")[0] in names:
            target, opts = parse_format(fmt, where)
            return make_rule(pattern, target, opts, where)
    raise ConvertError(f"{where}: expected REGEX=FORMAT with FORMAT one of {', '.join(names)} "
                       "(e.g. 'blocks\\.0\\.=int8-convrot', 'mlp=w4a8', 'attn=int8-convrot:g=64')")


def rules_from_data(data, source: str) -> tuple[Rule, ...]:
    """The rules of a parsed recipe (a list of rules, or an object with ``rules``)."""
    if isinstance(data, dict):
        if "rules" not in data:
            raise ConvertError(f"{source}: a recipe object needs a \"rules\" list")
        data = data["rules"]
    if not isinstance(data, list) or not data:
        raise ConvertError(f"{source}: \"rules\" must be a non-empty list of "
                           "{\"layer\": REGEX, \"format\": FORMAT} objects")
    out = []
    for i, item in enumerate(data, 1):
        where = f"{source}: rule {i}"
        if not isinstance(item, dict):
            raise ConvertError(f"{where} must be an object, got {type(item).__name__}")
        unknown = sorted(set(item) - RULE_KEYS)
        if unknown:
            raise ConvertError(f"{where}: unknown key(s) {', '.join(unknown)} "
                               f"(allowed: {', '.join(sorted(RULE_KEYS))})")
        if "layer" not in item or "format" not in item:
            raise ConvertError(f"{where} needs \"layer\" and \"format\"")
        if not isinstance(item["format"], str):
            raise ConvertError(f"{where}: \"format\" must be a string")
        target, opts = parse_format(item["format"], where)
        for key in ("g", "group_size", "layout", "linear", "linear_dtype"):
            if key in item:
                name = _OPTION_NAMES[key]
                if name in opts:
                    raise ConvertError(f"{where}: {name} given twice")
                opts[name] = _option_value(name, item[key], where)
        if target is None and opts:
            raise ConvertError(f"{where}: keep takes no options")
        out.append(make_rule(item["layer"], target, opts, where))
    return tuple(out)


def load_recipe(path: str | os.PathLike) -> tuple[Rule, ...]:
    """Read and check a recipe file (ConvertError naming the file and the rule)."""
    from h3quant.formats.container.smallfile import read_bounded
    from h3quant.limits import MAX_JSON_BYTES

    try:  # a FIFO, /dev/zero or a huge file: refused before reading
        raw = read_bounded(path, MAX_JSON_BYTES, "recipe")
    except UsageError as exc:
        raise ConvertError(f"cannot read recipe {path}: {exc.reason}") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConvertError(f"recipe {path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ConvertError(f"recipe {path} is nested too deeply to read") from None
    return rules_from_data(data, f"recipe {path}")


def recipe_data(rules, **notes) -> dict:
    """The JSON object of a recipe file (``notes``: free-form top-level keys)."""
    return {"rules": [r.to_dict() for r in rules], **notes}


# ------------------------------------------------------------------------------ checks on a file
@dataclass
class RuleUse:
    """What one rule does in a file: the layers it decides, and those earlier rules took."""

    index: int  # 1-based
    rule: Rule
    layers: list[str]
    shadowed: list[str]  # matched, but an earlier rule with another format won

    def to_dict(self) -> dict:
        return {"rule": self.index, "layer": self.rule.pattern, "format": self.rule.format,
                "layers": len(self.layers), "shadowed": len(self.shadowed)}


def first_match(rules, compiled, name: str) -> int | None:
    for i, pat in enumerate(compiled):
        if pat.search(name):
            return i
    return None


def check_rules(rules, compiled, candidates: list[str]) -> tuple[list[RuleUse], list[str]]:
    """Check the rules against the layers they may apply to (``candidates``: the layers the
    preset and ``--include``/``--exclude`` select, and every quantized layer).

    Usage errors (ConvertError): a rule that names no candidate layer; a rule every layer of
    which an earlier rule with another format takes (it would never apply). A rule shadowed on
    only some of its layers is the normal "specific first, catch-all last" recipe: the overlap
    is reported (returned as warnings), the first match wins."""
    uses = [RuleUse(i + 1, r, [], []) for i, r in enumerate(rules)]
    for name in candidates:
        hits = [i for i, pat in enumerate(compiled) if pat.search(name)]
        if not hits:
            continue
        uses[hits[0]].layers.append(name)
        for j in hits[1:]:
            if rules[j].format != rules[hits[0]].format:
                uses[j].shadowed.append(name)
    warnings = []
    for use in uses:
        if not use.layers and not use.shadowed:
            raise ConvertError(f"rule {use.index} {use.rule.text!r} names no layer this "
                               "conversion selects (check the pattern, --preset and "
                               "--include/--exclude)")
        if not use.layers:
            raise ConvertError(f"rule {use.index} {use.rule.text!r} never applies: every layer "
                               f"it names ({_few(use.shadowed)}) is taken by an earlier rule "
                               "with another format (the first match wins)")
        if use.shadowed:
            warnings.append(f"rule {use.index} {use.rule.text!r} also matches "
                            f"{len(use.shadowed)} layer(s) an earlier rule decides "
                            f"(first match wins): {_few(use.shadowed)}")
    return uses, warnings


def _few(names: list[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
