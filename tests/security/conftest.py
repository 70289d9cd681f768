"""The security tests drive the real local stack, as the e2e tests do: the same fixtures."""

from tests.e2e.conftest import pytest_runtest_makereport, s3_sites, stack  # noqa: F401
