"""Build one H3 block sharded for a rank: plan from the header shapes, read only the rank's bytes,
wrap the linears (column-parallel: the runtime's own layer on the rank's rows; row-parallel:
``RowParallelLinear``), and hand them to the runtime block's ``make_linear`` factory. The block
then runs attention on the rank's heads (qkv's output is the rank's heads of q, k and v) and its
SwiGLU on the rank's slice of gate and up; out_proj / fc2 return the full, reduced output.

With ``world = 1`` and ``LocalCollectives`` the same code is the single-device reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch

from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.layers import Layer, LayerScan
from h3quant.runtime.model.block import H3Block, build_block, quantized_linear
from h3quant.runtime.loader import BLOCK_LINEARS, LoadedBlock, LoadedLayer, load_layer
from h3quant.runtime.tp.group import Collectives
from h3quant.runtime.tp.linears import RowParallelLinear, column_linear
from h3quant.runtime.tp.plan import (
    ROW_PARALLEL,
    BlockPlan,
    ColumnShard,
    LayerShape,
    TpError,
    plan_block,
    regroup_note,
)
from h3quant.runtime.tp.shard_load import ShardReader, layer_shape, read_shard


@dataclass
class ShardInfo:
    """What one rank holds of one block."""

    index: int
    plan: BlockPlan
    shapes: dict[str, LayerShape]
    bytes_read: int = 0  # bytes of the block linears read from the file by this rank
    bytes_total: int = 0  # bytes of the block linears in the file
    notes: list[str] = field(default_factory=list)


def block_layers(scan: LayerScan, prefix: str) -> dict[str, Layer]:
    """Local name -> scanned layer of every layer under ``prefix`` (e.g. ``blocks.3``)."""
    return {n[len(prefix) + 1:]: lay for n, lay in scan.layers.items()
            if n.startswith(prefix + ".")}


def head_dim_of(layers: dict[str, Layer], prefix: str) -> int:
    q_norm = layers.get("attn.q_norm")
    w = q_norm.weight if q_norm is not None else None
    if w is None or len(w.shape) != 1 or not w.shape[0]:
        raise TpError("block has no 1-D attn.q_norm.weight to take head_dim from",
                      tensor=f"{prefix}.attn.q_norm.weight")
    return int(w.shape[0])


def shard_block(ckpt: Checkpoint, scan: LayerScan, prefix: str, index: int, comm: Collectives,
                *, mode: str, device, probe=None, backend: str | None = None,
                compute_dtype: torch.dtype | None = None) -> tuple[H3Block, ShardInfo]:
    """The block ``prefix`` as this rank runs it (``device``: a runtime Device)."""
    layers = block_layers(scan, prefix)
    missing = [r for r in BLOCK_LINEARS if r not in layers]
    if missing:
        raise TpError(f"block linear missing: {', '.join(missing)}", tensor=prefix)
    shapes = {r: layer_shape(layers[r], r) for r in BLOCK_LINEARS}
    head_dim = head_dim_of(layers, prefix)
    plan = plan_block(shapes, head_dim, comm.world, comm.rank)
    info = ShardInfo(index, plan, shapes, notes=regroup_note(plan, shapes))
    reader = ShardReader(ckpt)

    def make_local(layer):
        return quantized_linear(layer, device=device, backend=backend, probe=probe,
                                compute_dtype=compute_dtype)

    linears = {}
    for role in BLOCK_LINEARS:
        shard = plan.shard(role)
        layer = read_shard(reader, layers[role], shard)
        if isinstance(shard, ColumnShard):
            linears[role] = column_linear(layer, shard, make_local)
        else:
            linears[role] = RowParallelLinear(layer, shard, shapes[role].in_features, comm,
                                              mode=mode, device=device, probe=probe,
                                              make_local=make_local)
    info.bytes_read = reader.bytes_read
    info.bytes_total = sum(layers[r].nbytes for r in BLOCK_LINEARS)
    params = {n: load_layer(ckpt, lay) for n, lay in layers.items() if n not in BLOCK_LINEARS}
    # The runtime's own block builder: it checks the WHOLE block's shapes (shape-only stand-ins
    # of the linears) and takes the rank's shards from the make_linear factory.
    stand_in = LoadedBlock(index, prefix, {**params, **{r: cast(LoadedLayer, _ShapeOnly(r, s))
                                                       for r, s in shapes.items()}})
    block = build_block(stand_in, lambda lay: linears[lay.role], device=device.torch_device)
    return block, info


class _ShapeOnly:
    """A LoadedLayer stand-in with the unsharded shape (what ``check_block_shapes`` reads)."""

    def __init__(self, role: str, s: LayerShape) -> None:
        self.role, self.name = role, role
        self.out_features, self.in_features = s.out_features, s.in_features
        self.tensors = {"weight": None}


def held_bytes(block: H3Block) -> int:
    """Bytes of the tensors the block's linears hold (weights, scales, biases)."""
    seen, total = set(), 0
    for lin in block.linears().values():
        for t in list(lin.buffers()) + [getattr(lin, "w_t", None), getattr(lin, "weight", None)]:
            if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        if isinstance(lin, RowParallelLinear) and lin.local is not None:
            total += held_bytes_of(lin.local, seen)
    return total


def held_bytes_of(mod, seen) -> int:
    total = 0
    for t in mod.buffers():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def row_input_slice(x: torch.Tensor, role: str, world: int, rank: int) -> torch.Tensor:
    """The rank's natural slice of a row-parallel layer's full input (heads / fc1 slice).
    For fc2's fused SwiGLU input ``[gate | up]`` use ``swiglu_input_slice``."""
    if role not in ROW_PARALLEL:
        raise TpError(f"{role} is not row-parallel")
    w = x.shape[-1] // world
    return x[..., rank * w:(rank + 1) * w]


def swiglu_input_slice(x: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """The rank's ``[gate_r | up_r]`` of a full ``[gate | up]`` input (what its fc1 shard emits)."""
    gate, up = x.chunk(2, dim=-1)
    w = gate.shape[-1] // world
    return torch.cat((gate[..., rank * w:(rank + 1) * w], up[..., rank * w:(rank + 1) * w]), -1)


def assemble_columns(parts: list[torch.Tensor], stacked: int) -> torch.Tensor:
    """Full column-parallel output from every rank's ``[part_0 | part_1 | ...]`` outputs."""
    chunks = [p.chunk(stacked, dim=-1) for p in parts]
    return torch.cat([c[j] for j in range(stacked) for c in chunks], dim=-1)
