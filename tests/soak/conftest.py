"""The soak runs on the real server: the same fixtures as tests/real."""

from tests.real.conftest import real_binary, real_model  # noqa: F401  (fixtures)
