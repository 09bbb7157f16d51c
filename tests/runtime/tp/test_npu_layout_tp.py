"""Tensor parallel over an int8_tensorwise_kn file: shards come from the stored [K, N] (a K shard
is one contiguous byte range), and tp = 2 / 4 stay bit-identical to one device."""

import pytest

from h3quant.pipelines.convert import ConvertOptions, convert
from h3quant.pipelines.verify.tp import verify_tp

pytestmark = pytest.mark.slow  # processes / tensor-parallel ranks: the slow subset


@pytest.fixture(scope="module")
def kn_file(tp_files):
    files = tp_files
    out = files["dir"] / "kn.safetensors"
    if not out.exists():
        convert(files["int8"], out, ConvertOptions(layout="npu", report=False))
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_kn_shards_are_bit_identical_to_one_device(kn_file, tp_files, tp):
    res = verify_tp(kn_file, tp=tp, scale_mode="shared", device="cpu", blocks=1, tokens=8,
                    start_method="fork", timeout_s=60)
    assert res.passed, res.failures
    assert all(c.identical and c.max_abs == 0 for c in res.checks)
    for r in res.ranks:  # each rank read about 1/tp of the linears
        assert r.bytes_read < res.linear_bytes * (0.6 if tp == 2 else 0.35)
    canon = verify_tp(tp_files["int8"], tp=tp, scale_mode="shared", device="cpu", blocks=1,
                      tokens=8, start_method="fork", timeout_s=60)
    assert [c.rel_l2 for c in res.checks] == [c.rel_l2 for c in canon.checks]
