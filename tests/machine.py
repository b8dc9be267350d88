"""What a test needs of the machine: `skip_or_fail` skips a test the machine cannot host, and fails it
under MEGAHET_REQUIRE_ALL=1 (set by .ci/run), so that CI cannot lose a test to a silent skip. Shared by
the unit and the distributed tests (tests/ is on their path: its conftest.py is there)."""

from __future__ import annotations

import os

import pytest

REQUIRE_ALL = "MEGAHET_REQUIRE_ALL"
"""Set (to 1) by .ci/run: a test the machine cannot host fails instead of skipping, so CI cannot lose it."""


def skip_or_fail(reason: str) -> None:
    """Skip the test because the machine cannot host it; under MEGAHET_REQUIRE_ALL=1 (CI), fail."""
    if os.environ.get(REQUIRE_ALL) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ALL}=1: CI must run this test, so it fails instead of skipping)")
    pytest.skip(reason)
