"""Fixtures of the tensor-parallel tests."""

import pytest


@pytest.fixture(scope="session")
def files(tp_files):
    """The converted tiny files of tests/conftest.py's ``tp_files`` (BF16, int8 ConvRot in both
    layouts, W4A8)."""
    return tp_files
