"""Fixtures of the header-command tests (inspect, validate)."""

import pytest
from helpers.forge import quantized_synth
from helpers.scratch import SESSION_SCRATCH


@pytest.fixture(scope="session")
def h3(tmp_path_factory):
    """A quantized synthetic H3 file with its markers in the header (made once for both modules)."""
    return quantized_synth(tmp_path_factory.mktemp(SESSION_SCRATCH + "h3") / "h3_int8.safetensors")
