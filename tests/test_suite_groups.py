"""The suite's own machinery: pyproject runs it on two workers with ``--dist loadgroup``, and tests/conftest.py
groups the tests of one model so that it is built and read on one worker only."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.xdist_group("suite-groups")


def test_a_group_stays_on_one_worker(request: pytest.FixtureRequest) -> None:
    """pytest-xdist marks a grouped test by suffixing its node id with the group: without the suffix (pytest 9.2 with
    xdist 3.8) every group is split over the workers, and each builds the models of its half again."""
    if "PYTEST_XDIST_WORKER" not in os.environ or not request.config.getoption("loadgroup", False):
        pytest.skip("runs under the suite's own options (two workers, --dist loadgroup)")
    assert request.node.nodeid.endswith("@suite-groups"), request.node.nodeid
