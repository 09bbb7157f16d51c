"""Tensor-parallel sharding plan of one H3 block (FORMATS.md section 7).

Which rows or which K columns of each block linear a rank holds, decided from the layer shapes
alone (no data, no torch.distributed):

- column-parallel (split N), exact: ``attn.qkv_proj`` -- the rank's heads' rows of EACH of q, k
  and v (``[q; k; v]`` is stored stacked, so a contiguous third would hand a rank all of q);
  ``mlp.fc1`` -- the rank's slice of EACH of gate and up, so SwiGLU pairs meet on one rank.
- row-parallel (split K): ``attn.out_proj`` (input: the attention output, sharded by heads) and
  ``mlp.fc2`` (input: the SwiGLU output, sharded like fc1's slices). A K slice must hold whole
  rotation groups (the activation is rotated per group before it is quantized).

Strategy when the natural K slice (the rank's heads, or its fc1 slice) would split a rotation
group -- H3's out_proj at tp = 8 (7168 / 8 = 896 = 3.5 x 256), or the tiny preset's out_proj at
tp = 4 -- is ``regroup``: the ranks all_gather their slices of the layer input (each then holds
the whole [M, K] activation) and each rank takes a contiguous run of WHOLE rotation groups, the
first ``G % N`` ranks one group more (28 groups over 8 ranks: 4,4,4,4,3,3,3,3). The result is
still bit-identical to one device (the shared-scale arithmetic below does not care where K is
cut, as long as no group is cut); the cost is one all_gather of the activation and an uneven
weight share. Nothing is refused and nothing is silently computed wrong.

int32 partial sums: ``|q_x| <= 127`` (the shared scale maps the row abs-max to 127) and
``|q_w| <= 128``, so any partial or total sum over K terms stays below ``127 * 128 * K``, which
fits an int32 while ``K <= MAX_INT32_K = 132104``. H3's widest K (fc2, 14336) is 9x below.
"""

from __future__ import annotations

from dataclasses import dataclass

from h3quant.errors import TpError as TpError  # its home; importable from here as before

COLUMN_PARALLEL = {"attn.qkv_proj": 3, "mlp.fc1": 2}  # number of stacked parts ([q;k;v], [gate;up])
ROW_PARALLEL = ("attn.out_proj", "mlp.fc2")
MAX_INT32_K = (2**31 - 1) // (127 * 128)  # 132104
SCALE_MODES = ("shared", "per-rank")


@dataclass(frozen=True)
class LayerShape:
    """What the plan needs of one linear: ``[N, K]`` and its K alignment unit (the ConvRot group
    size, or 1 without rotation)."""

    name: str
    out_features: int
    in_features: int
    align: int = 1


@dataclass(frozen=True)
class ColumnShard:
    """Rows ``[r0, r1)`` of the stored weight, one range per stacked part, for one rank."""

    rows: tuple[tuple[int, int], ...]

    @property
    def out_features(self) -> int:
        return sum(r1 - r0 for r0, r1 in self.rows)


@dataclass(frozen=True)
class RowShard:
    """Columns ``[k0, k1)`` of the stored weight for one rank; ``gather``: the rank needs the whole
    input (``regroup``) instead of arriving with exactly this slice (``split``)."""

    k0: int
    k1: int
    strategy: str  # "split" or "regroup"

    @property
    def gather(self) -> bool:
        return self.strategy == "regroup"

    @property
    def width(self) -> int:
        return self.k1 - self.k0


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_world(world: int) -> None:
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise TpError(f"tensor-parallel degree must be a positive integer, got {world!r}")


def column_shard(shape: LayerShape, world: int, rank: int, unit: int = 1) -> ColumnShard:
    """The rank's rows of each stacked part; ``unit``: rows that must stay together (head_dim)."""
    parts = COLUMN_PARALLEL[_role(shape.name)]
    if shape.out_features % parts:
        raise TpError(f"{shape.out_features} rows do not stack {parts} equal parts",
                      tensor=shape.name)
    height = shape.out_features // parts
    units = height // unit if unit else 0
    if unit <= 0 or height % unit or units % world:
        what = (f"{units} attention heads (head_dim {unit})" if unit > 1 else f"width {height}")
        ok = ", ".join(str(d) for d in divisors(units) if d <= 64)
        raise TpError(f"tp={world} does not divide the {what} of each of the {parts} stacked "
                      f"parts; tp must divide {units} (e.g. {ok})", tensor=shape.name)
    per = height // world
    return ColumnShard(tuple((p * height + rank * per, p * height + (rank + 1) * per)
                             for p in range(parts)))


def row_shard(shape: LayerShape, world: int, rank: int) -> RowShard:
    """The rank's K columns: the natural equal slice when it holds whole alignment units, else
    ``regroup`` (see the module docstring)."""
    k, a = shape.in_features, max(1, shape.align)
    if k > MAX_INT32_K:
        raise TpError(f"K={k} exceeds {MAX_INT32_K}: int32 partial sums could overflow "
                      "(127 * 128 * K >= 2**31); the shared activation scale needs int32 "
                      "accumulation", tensor=shape.name)
    if k % world:
        raise TpError(f"tp={world} does not divide the input width K={k}", tensor=shape.name)
    w = k // world
    if w % a == 0:
        return RowShard(rank * w, (rank + 1) * w, "split")
    if k % a:
        raise TpError(f"alignment {a} does not divide K={k}", tensor=shape.name)
    groups = k // a
    base, extra = divmod(groups, world)
    start = rank * base + min(rank, extra)
    count = base + (1 if rank < extra else 0)
    return RowShard(start * a, (start + count) * a, "regroup")


def _role(name: str) -> str:
    for role in (*COLUMN_PARALLEL, *ROW_PARALLEL):
        if name == role or name.endswith("." + role):
            return role
    raise TpError("not a block linear tensor parallel knows how to split", tensor=name)


@dataclass(frozen=True)
class BlockPlan:
    """Every block linear's shard for one rank of ``world``."""

    world: int
    rank: int
    head_dim: int
    columns: dict[str, ColumnShard]
    rows: dict[str, RowShard]

    def shard(self, role: str) -> ColumnShard | RowShard:
        return self.columns[role] if role in self.columns else self.rows[role]

    @property
    def strategies(self) -> dict[str, str]:
        return {role: s.strategy for role, s in self.rows.items()}


def plan_block(shapes: dict[str, LayerShape], head_dim: int, world: int, rank: int) -> BlockPlan:
    """The plan of one block from its four linears' shapes (keys: the roles)."""
    check_world(world)
    if not 0 <= rank < world:
        raise TpError(f"rank {rank} is outside the group of {world}")
    missing = [r for r in (*COLUMN_PARALLEL, *ROW_PARALLEL) if r not in shapes]
    if missing:
        raise TpError(f"block has no {', '.join(missing)}: cannot shard it")
    cols = {"attn.qkv_proj": column_shard(shapes["attn.qkv_proj"], world, rank, unit=head_dim),
            "mlp.fc1": column_shard(shapes["mlp.fc1"], world, rank)}
    rows = {role: row_shard(shapes[role], world, rank) for role in ROW_PARALLEL}
    return BlockPlan(world, rank, head_dim, cols, rows)


def regroup_note(plan: BlockPlan, shapes: dict[str, LayerShape]) -> list[str]:
    """Human notes on the layers that use the regroup strategy (empty when none does)."""
    out = []
    for role, shard in plan.rows.items():
        if shard.gather:
            s = shapes[role]
            out.append(f"{role}: tp={plan.world} would cut rotation groups of {s.align} "
                       f"(K={s.in_features}, {s.in_features // plan.world} per rank): input "
                       f"all_gathered, each rank takes whole groups "
                       f"({_group_counts(s, plan.world)})")
    return out


def _group_counts(shape: LayerShape, world: int) -> str:
    counts = [row_shard(shape, world, r).width // shape.align for r in range(world)]
    return ",".join(str(c) for c in counts) + " groups per rank"
