"""``plan``: measure how much each block (or linear) matters to the whole model's output, and
choose per-layer formats that meet a quality target or a size budget (a ``convert --recipe``)."""
