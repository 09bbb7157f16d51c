"""The source layouts an H3 checkpoint comes in, behind one small protocol and one registry.

A layout knows how to recognise itself (``detect``), how its names and rows map onto ComfyUI's
single file (``rename``, ``split_qkv``, ``row_op``; ``h3quant.h3.naming.plan_mapping`` runs
them) and how to describe itself (``title`` for inspect, ``help`` for the CLI, the shard stem
and config class synth writes). The CLI's ``--naming`` choices, inspect's descriptions, the
mapping and synth's writers all read ``LAYOUTS``; a new layout is one class and one entry here
(FORMATS.md 12). Names and shapes only: never imports torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

# Row operations (``naming.Target.op``)
COPY = "copy"  # the source as it is
FUSE_QKV = "fuse-qkv"  # [to_q; to_k; to_v]
DEINTERLEAVE_QKV = "deinterleave-qkv"  # per-head [q_h; k_h; v_h] -> [q_all; k_all; v_all]
SWAP_HALVES = "swap-halves"  # [value; gate] -> [gate; value]


class SourceLayout(Protocol):
    """What every source layout provides."""

    # Read-only data (the layouts are frozen dataclasses), declared as properties.
    @property
    def name(self) -> str:
        """The ``--naming`` value."""

    @property
    def label(self) -> str:
        """How its names are called in a message ("ComfyUI name(s)")."""

    @property
    def title(self) -> str:
        """inspect's description ("ComfyUI single file")."""

    @property
    def help(self) -> str:
        """One clause of the CLI's help text."""

    @property
    def shard_stem(self) -> str | None:
        """Shard file stem synth writes (None: a single file)."""

    @property
    def config_class(self) -> str | None:
        """``_class_name`` of the config.json synth writes."""

    @property
    def name_hint(self) -> re.Pattern | None:
        """Names only this layout (or one sharing its names) uses."""

    def detect(self, hits: dict[str, list[str]], shard_names: list[str],
               has_config: bool) -> str | None:
        """Evidence that a checkpoint is in this layout (None: it is not), from the names each
        layout's ``name_hint`` matched and the shard file names."""

    def rename(self, name: str) -> str:
        """A source tensor's ComfyUI name (split q/k/v aside)."""

    def split_qkv(self, name: str) -> re.Match | None:
        """A split q/k/v projection (groups ``stem``, ``part``, ``kind``), fused by the mapping."""

    def row_op(self, name: str) -> str:
        """The row operation that turns the source tensor into ComfyUI's."""


@dataclass(frozen=True)
class Comfy:
    """ComfyUI's single file: the layout every other command reads and ComfyUI loads."""

    name: str = "comfy"
    label: str = "ComfyUI"
    title: str = "ComfyUI single file"
    help: str = "comfy = ComfyUI's single file"
    shard_stem: str | None = None
    config_class: str | None = None
    name_hint: re.Pattern | None = re.compile(
        r"^(?:blocks\.\d+\.|video_patch_proj\.|audio_patch_proj\.|condition_proj\.|final_layer\.|"
        r"time_embedder\.proj_(?:in|out)\.|token_refiner\.blocks\.)|\.attn\.qkv_proj\.|"
        r"\.mlp\.fc[12]\.")

    def detect(self, hits, shard_names, has_config):
        return "ComfyUI names"  # the fallback: ComfyUI's names, or none of H3's

    def rename(self, name):
        return name

    def split_qkv(self, name):
        return None

    def row_op(self, name):
        return COPY


OFFICIAL_SHARD = re.compile(r"^model-\d+-of-\d+\.safetensors$")


@dataclass(frozen=True)
class Official(Comfy):
    """The native release shards: ComfyUI's names, each fused ``attn.qkv_proj`` per head."""

    name: str = "official"
    label: str = "official"
    title: str = "official native shards"
    help: str = ("official = a directory of model-NNNNN-of-MMMMM shards + index, q/k/v rows "
                 "per head")
    shard_stem: str | None = "model"
    config_class: str | None = "MiniMaxH3"
    name_hint: re.Pattern | None = None  # its names are ComfyUI's: told by its shard names

    def detect(self, hits, shard_names, has_config):
        if has_config and len(shard_names) > 1 and all(OFFICIAL_SHARD.match(s)
                                                       for s in shard_names):
            return "native names in model-NNNNN-of-MMMMM shards beside config.json"
        return None

    def row_op(self, name):
        return DEINTERLEAVE_QKV if name.endswith(".attn.qkv_proj.weight") else COPY


# diffusers -> ComfyUI renames, applied in order to each name (first matching rule of each kind).
DIFFUSERS_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^proj_in\.", "video_patch_proj."),
    (r"^audio_proj_in\.", "audio_patch_proj."),
    (r"^context_embedder\.", "condition_proj."),
    (r"^time_embedder\.linear_1\.", "time_embedder.proj_in."),
    (r"^time_embedder\.linear_2\.", "time_embedder.proj_out."),
    (r"^norm_out\.linear\.", "final_layer.adaln_proj.linear."),
    (r"^norm_out\.norm\.", "final_layer.norm."),
    (r"^proj_out\.", "final_layer.video_out."),
    (r"^audio_proj_out\.", "final_layer.audio_out."),
    (r"^token_refiner\.refiner_blocks\.", "token_refiner.blocks."),
    (r"^transformer_blocks\.", "blocks."),
    (r"\.attn\.to_out\.0\.", ".attn.out_proj."),
    (r"\.attn\.norm_q\.", ".attn.q_norm."),
    (r"\.attn\.norm_k\.", ".attn.k_norm."),
    (r"\.ff\.net\.0\.proj\.", ".mlp.fc1."),
    (r"\.ff\.net\.2\.", ".mlp.fc2."),
)
_SPLIT_QKV = re.compile(r"^(?P<stem>.*)\.attn\.to_(?P<part>[qkv])\.(?P<kind>weight|bias)$")


@dataclass(frozen=True)
class Diffusers(Comfy):
    """``MiniMaxH3Transformer3DModel`` shards: renamed modules, split ``to_q`` / ``to_k`` /
    ``to_v``, the SwiGLU ``ff.net.0.proj`` as ``[value; gate]`` (ComfyUI: ``[gate; value]``)."""

    name: str = "diffusers"
    label: str = "diffusers"
    title: str = "diffusers shards"
    help: str = ("diffusers = a directory of diffusion_pytorch_model shards, diffusers names, "
                 "split to_q/to_k/to_v, SwiGLU as [value; gate]")
    shard_stem: str | None = "diffusion_pytorch_model"
    config_class: str | None = "MiniMaxH3Transformer3DModel"
    name_hint: re.Pattern | None = re.compile(
        r"^(?:transformer_blocks\.|proj_in\.|audio_proj_in\.|context_embedder\.|norm_out\.|"
        r"proj_out\.|audio_proj_out\.|time_embedder\.linear_[12]\.|"
        r"token_refiner\.refiner_blocks\.)|\.attn\.to_[qkvo]|\.ff\.net\.")

    def detect(self, hits, shard_names, has_config):
        names = hits.get(self.name)
        return f"diffusers names (e.g. {names[0]})" if names else None

    def rename(self, name):
        for pattern, repl in DIFFUSERS_RENAMES:
            name = re.sub(pattern, repl, name)
        return name

    def split_qkv(self, name):
        return _SPLIT_QKV.match(name)

    def row_op(self, name):
        return SWAP_HALVES if ".ff.net.0.proj." in name else COPY


# The registry: CLI order; detection asks them in DETECT_ORDER. TARGET is the layout every
# other command reads and convert writes (ComfyUI's single file), the default of synth.
LAYOUTS: dict[str, SourceLayout] = {lay.name: lay for lay in (Comfy(), Official(), Diffusers())}
DETECT_ORDER = (Diffusers.name, Official.name, Comfy.name)
TARGET = Comfy.name
NAMINGS = tuple(LAYOUTS)


def diffusers_to_comfy(name: str) -> str:
    """A diffusers tensor name as ComfyUI names it (split q/k/v and SwiGLU order aside)."""
    return LAYOUTS[Diffusers.name].rename(name)


def get(name: str) -> SourceLayout:
    return LAYOUTS[name]


def names() -> tuple[str, ...]:
    return NAMINGS


def help_text() -> str:
    """The ``--naming`` choices explained, for the CLI's help."""
    return "; ".join(lay.help for lay in LAYOUTS.values()) + "."
