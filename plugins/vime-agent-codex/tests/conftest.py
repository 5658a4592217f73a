"""The docker image fixture (skips, with the reason printed, only when dockerd is unreachable)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def docker_image() -> str:
    try:
        from vime_sandbox_docker.image import build_image
        from vime_sandbox_docker.sandbox import DEFAULT_IMAGE, docker_client

        docker_client(timeout_s=10).ping()
    except Exception as e:  # noqa: BLE001 - any failure to reach the daemon or a missing plugin
        reason = f"docker sandbox unavailable ({type(e).__name__}: {e}); run scripts/ci_services.sh"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    return build_image(DEFAULT_IMAGE)
