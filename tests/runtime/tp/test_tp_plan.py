"""Tensor parallel without processes: the sharding plan, per-rank reads, int32 edges, the
row-parallel arithmetic against the single-device runtime layer (FORMATS.md 7)."""

from itertools import pairwise

import pytest
import torch

from h3quant.formats.container.checkpoint import Checkpoint
from h3quant.formats.layers import scan_checkpoint
from h3quant.runtime.devices import parse_device
from h3quant.runtime.linear import QuantizedLinear
from h3quant.runtime.loader import LoadedLayer, load_blocks
from h3quant.runtime.tp.group import LocalCollectives
from h3quant.runtime.tp.linears import RowParallelLinear, quantize_shared
from h3quant.runtime.tp.plan import (
    MAX_INT32_K,
    LayerShape,
    RowShard,
    TpError,
    column_shard,
    plan_block,
    row_shard,
)
from h3quant.runtime.tp.runner import block_layers
from h3quant.runtime.tp.shard_load import ShardReader, layer_shape, read_shard

H3 = {"attn.qkv_proj": LayerShape("attn.qkv_proj", 3 * 7168, 5376, 256),
      "attn.out_proj": LayerShape("attn.out_proj", 5376, 7168, 256),
      "mlp.fc1": LayerShape("mlp.fc1", 2 * 14336, 5376, 256),
      "mlp.fc2": LayerShape("mlp.fc2", 5376, 14336, 256)}


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_h3_plan_covers_every_row_and_column_once(world):
    plans = [plan_block(H3, 128, world, r) for r in range(world)]
    for role, parts in (("attn.qkv_proj", 3), ("mlp.fc1", 2)):
        rows = sorted(rng for p in plans for rng in p.columns[role].rows)
        height = H3[role].out_features // parts
        # each rank: one equal slice of EACH stacked part (its heads of q, k and v)
        assert all(len(p.columns[role].rows) == parts for p in plans)
        assert rows[0][0] == 0 and rows[-1][1] == H3[role].out_features
        assert all(a[1] == b[0] for a, b in pairwise(rows))
        assert all(r1 - r0 == height // world for r0, r1 in rows)
    for role in ("attn.out_proj", "mlp.fc2"):
        shards = [p.rows[role] for p in plans]
        assert shards[0].k0 == 0 and shards[-1].k1 == H3[role].in_features
        assert all(a.k1 == b.k0 for a, b in pairwise(shards))
        assert all(s.k0 % 256 == 0 and s.k1 % 256 == 0 for s in shards)  # whole rotation groups


def test_tp8_regroups_out_proj_and_splits_fc2():
    plans = [plan_block(H3, 128, 8, r) for r in range(8)]
    assert [p.rows["attn.out_proj"].width // 256 for p in plans] == [4, 4, 4, 4, 3, 3, 3, 3]
    assert all(p.rows["attn.out_proj"].strategy == "regroup" for p in plans)
    assert all(p.rows["mlp.fc2"].strategy == "split" for p in plans)  # 14336 / 8 = 7 x 256
    assert [p.rows["mlp.fc2"].width for p in plans] == [1792] * 8


@pytest.mark.parametrize("world", [3, 5, 16])
def test_tp_not_dividing_heads_is_refused_with_the_reason(world):
    with pytest.raises(TpError, match=rf"tp={world} does not divide the 56 attention heads"):
        plan_block(H3, 128, world, 0)


def test_tp_not_dividing_ffn_is_refused():
    shapes = dict(H3, **{"mlp.fc1": LayerShape("mlp.fc1", 2 * 1004, 5376, 1)})
    with pytest.raises(TpError, match="tp=8 does not divide the width 1004"):
        column_shard(shapes["mlp.fc1"], 8, 0)


def test_qkv_rank_takes_its_heads_of_each_of_q_k_v():
    s = column_shard(LayerShape("attn.qkv_proj", 3 * 512, 512, 256), 4, 1, unit=128)
    assert s.rows == ((128, 256), (512 + 128, 512 + 256), (1024 + 128, 1024 + 256))


def test_int32_limit_is_the_contract_bound():
    assert MAX_INT32_K == 132104
    assert 127 * 128 * MAX_INT32_K < 2**31 <= 127 * 128 * (MAX_INT32_K + 1)
    assert 127 * 128 * max(s.in_features for s in H3.values()) < 2**31  # H3 widths are safe
    row_shard(LayerShape("x.attn.out_proj", 8, MAX_INT32_K, 1), 1, 0)
    with pytest.raises(TpError, match="int32 partial sums could overflow"):
        row_shard(LayerShape("x.attn.out_proj", 8, MAX_INT32_K + 1, 1), 1, 0)


def test_int32_sum_at_the_edge_is_exact():
    """Worst case at K = MAX_INT32_K: every activation code 127, every weight code -128 -- the
    int32 matmul and the int32 all_reduce SUM of two halves stay exact (no wrap)."""
    k = MAX_INT32_K
    q_x = torch.full((2, k), 127, dtype=torch.int8)
    w = torch.full((k, 8), -128, dtype=torch.int8)
    exact = -127 * 128 * k
    assert torch._int_mm(q_x, w).eq(exact).all()
    halves = torch._int_mm(q_x[:, : k // 2], w[: k // 2]) + torch._int_mm(q_x[:, k // 2:], w[k // 2:])
    assert halves.dtype == torch.int32 and halves.eq(exact).all()
    assert exact > -(2**31)


def test_shared_quantizer_equals_the_codec_on_one_rank():
    from h3quant.formats.int8.tensors import quantize_activation

    x = torch.randn(33, 512) * torch.logspace(-3, 3, 33)[:, None]
    x[3] = 0
    q, s = quantize_shared(x, x.abs().amax(1))
    q2, s2 = quantize_activation(x)
    assert torch.equal(q, q2) and torch.equal(s, s2)


# ------------------------------------------------------------------------- per-rank reads


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int8", "w4a8", "kn"])
@pytest.mark.parametrize("mmap", [True, False])
def test_each_rank_reads_only_its_bytes_and_they_are_the_right_ones(files, fmt, mmap):
    world = 2
    full = load_blocks(files[fmt], [0])[0]
    with Checkpoint(files[fmt], mmap=mmap) as ckpt:
        scan = scan_checkpoint(ckpt)
        layers = block_layers(scan, "blocks.0")
        shapes = {r: layer_shape(layers[r], r) for r in H3}
        total = sum(layers[r].nbytes for r in H3)
        read = []
        for rank in range(world):
            plan = plan_block(shapes, 128, world, rank)
            reader = ShardReader(ckpt)
            for role in H3:
                part = read_shard(reader, layers[role], plan.shard(role))
                q, s = part.int8_grid()
                fq, fs = full.linear(role).int8_grid()
                sh = plan.shard(role)
                if role in plan.columns:
                    idx = torch.cat([torch.arange(a, b) for a, b in sh.rows])
                    assert torch.equal(q, fq[idx]) and torch.equal(s, fs[idx])
                else:
                    assert torch.equal(q, fq[:, sh.k0:sh.k1]) and torch.equal(s, fs)
            read.append(reader.bytes_read)
    # each rank reads half of the weight bytes plus the replicated per-row scales of the K shards
    for r in read:
        assert 0.45 * total < r < 0.56 * total


def _row_layer(k=1024, n=96, convrot=True, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, 1, generator=g) * 0.01 + 1e-3
    t = {"weight": q, "weight_scale": s}
    if bias:
        t["bias"] = torch.randn(n, generator=g)
    fields = {"format": "int8_tensorwise", "convrot": convrot, "convrot_groupsize": 256,
              "full_precision_matrix_mult": False}
    return LoadedLayer("blocks.0.mlp.fc2", t, fields, "header")


@pytest.mark.parametrize("convrot", [True, False])
def test_row_parallel_on_one_rank_equals_the_runtime_layer_bit_for_bit(convrot):
    layer = _row_layer(convrot=convrot)
    dev = parse_device("cpu")
    x = torch.randn(2, 7, 2 * 1024)  # fused SwiGLU input
    lin = RowParallelLinear(layer, RowShard(0, 1024, "split"), 1024, LocalCollectives(),
                            mode="shared", device=dev, probe=None, make_local=None)
    ref = QuantizedLinear.from_int8(layer.weight, layer.tensors["weight_scale"], convrot=convrot,
                                    bias=layer.bias)
    assert ref.backend_name == "torch-int8"
    assert torch.equal(lin(x, input_act="swiglu"), ref(x, input_act="swiglu"))
    assert torch.equal(lin(x[..., :1024]), ref(x[..., :1024]))


def test_bad_scale_mode_is_refused():
    with pytest.raises(TpError, match="unknown scale mode"):
        RowParallelLinear(_row_layer(), RowShard(0, 1024, "split"), 1024, LocalCollectives(),
                          mode="avg", device=parse_device("cpu"), probe=None, make_local=None)
