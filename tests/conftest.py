"""Shared fixtures. Docker tests (marker `docker`) skip with the reason when no engine answers,
unless WIIIIIDE_REQUIRE_DOCKER=1, where a missing engine is a failure (CI sets it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def pytest_collection_modifyitems(config, items):
    if not any(item.get_closest_marker("docker") for item in items):
        return
    from harness.run.docker_client import engine_problem
    problem = engine_problem()
    if problem is None:
        return
    required = os.environ.get("WIIIIIDE_REQUIRE_DOCKER") == "1"
    for item in items:
        if item.get_closest_marker("docker"):
            if not required:  # required: the docker_ready fixture fails the test with the problem
                item.add_marker(pytest.mark.skip(reason=f"no Docker engine answered: {problem} "
                                                        "(start one with `make docker-engine`)"))


@pytest.fixture(scope="session")
def docker_ready(request):
    """The engine answers and the node image exists (built if missing). Fails when required and absent."""
    from harness.run.docker_client import engine_problem
    problem = engine_problem()
    if problem is not None:
        pytest.fail(f"WIIIIIDE_REQUIRE_DOCKER=1 but no Docker engine answered: {problem}")
    from harness.run.image import build_image
    build_image(log=lambda line: print(line, file=sys.stderr))  # seconds when cached; never stale
    return True
