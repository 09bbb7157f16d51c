"""Two statistics files compared as ``capture --tp`` promises: the same tensors and metadata,
each tensor within rtol 1e-4 and an absolute floor of 1e-5 of its largest magnitude.

Why that tolerance: the sharded blocks sum out_proj's and fc2's partial products across ranks
in fp32, so each block's output (the next block's input) differs from one device by float32
rounding (~1e-7 relative), carried through the following blocks; entries of H near zero are
sums of cancelling terms (hence the floor)."""

from __future__ import annotations

import torch


def stats_tensors(path):
    """Every tensor of a statistics file, and its metadata."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()


def assert_same_statistics(reference, other) -> dict:
    """Fails unless ``other`` holds ``reference``'s statistics within the tolerance above;
    returns the reference's tensors."""
    one, meta1 = stats_tensors(reference)
    two, meta2 = stats_tensors(other)
    assert meta1 == meta2
    assert one.keys() == two.keys()
    for k, a in one.items():
        b = two[k]
        assert a.shape == b.shape, k
        floor = 1e-5 * float(a.abs().max())
        assert torch.allclose(b, a, rtol=1e-4, atol=floor), \
            f"{k}: max diff {float((b - a).abs().max())}"
    return one
