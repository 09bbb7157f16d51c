"""The name prefix of a directory a session-scoped fixture makes with tmp_path_factory.mktemp.

tests/conftest.py removes every other directory made under the run's base temp when its module
ends; one with this prefix lives until the run ends."""

SESSION_SCRATCH = "session-"
