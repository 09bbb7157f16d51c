"""Helpers shared by the test modules (no tests here): forged and synthetic H3 files
(``forge``, ``h3files``), an independent float H3 forward (``independent_h3``) and an independent
weight quantizer (``runtime``). The shared pytest fixtures are in tests/conftest.py."""
