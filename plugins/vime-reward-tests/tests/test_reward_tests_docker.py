"""The tests reward on the docker sandbox (``vime-sandbox:bookworm``: python3 without pytest; the host's pytest is
shipped in): the same exact values as on the local sandbox."""

from __future__ import annotations

import asyncio

import pytest
from reward_tests_cases import HACK, PARTIAL, task_sample

from vime_core.plugins.manager import get_plugins
from vime_core.testing.plugin_context import plugin_context

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def docker_args():
    try:
        from vime_sandbox_docker.image import build_image
        from vime_sandbox_docker.sandbox import DEFAULT_IMAGE, docker_client

        docker_client(timeout_s=10).ping()
    except Exception as e:  # noqa: BLE001 - any failure to reach the daemon
        reason = f"dockerd unreachable ({type(e).__name__}: {e}); start it with scripts/ci_services.sh"
        print(f"SKIP docker tests reward: {reason}")
        pytest.skip(reason)
    return plugin_context(sandbox="docker", sandbox_docker_image=build_image(DEFAULT_IMAGE))


def test_exact_rewards_in_docker(docker_args):
    reward = get_plugins().resolve("reward", "tests")
    cases = [
        (task_sample({"solution.py": "def add(a, b):\n    return a + b\n"}), 1.0),
        (task_sample({"solution.py": PARTIAL}), 2 / 3),
        (task_sample(HACK), 1 / 3),
        (task_sample(None), 0.0),
    ]

    async def all_cases():
        return await asyncio.gather(*(reward(docker_args, s) for s, _ in cases))

    assert asyncio.run(all_cases()) == [expected for _, expected in cases]
    assert cases[2][0].metadata["reward_tests"]["ignored"] == [
        "conftest.py",
        "pytest.ini",
        "sitecustomize.py",
        "sub/conftest.py",
        "test_solution.py",
    ]
