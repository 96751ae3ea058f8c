"""Every test here runs real gloo processes: a tighter per-test limit than pytest.ini's default.

The slowest measured (2 loaded cores) takes 27 s, most of it a module fixture's launch; 240 s is
about nine times that. A broken rendezvous then fails naming the test, and run_distributed's own
limit (180 s, below this one) fails first naming the rank that did not answer.
"""

from __future__ import annotations

import pytest

DIST_TIMEOUT_S = 240


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if "/tests/dist/" in str(item.path) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DIST_TIMEOUT_S))
