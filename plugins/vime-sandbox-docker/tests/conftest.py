"""Shared fixtures: whether dockerd answers (tests skip, with the reason printed, only if it does not) and the
sandbox image (built once per session if missing: debootstrap rootfs cached under ~/.cache/vime/rootfs)."""

from __future__ import annotations

import pytest


def docker_unreachable_reason() -> str | None:
    try:
        from vime_sandbox_docker.sandbox import docker_client

        docker_client(timeout_s=10).ping()
        return None
    except Exception as e:  # noqa: BLE001 - any failure to reach the daemon
        return f"dockerd unreachable ({type(e).__name__}: {e}); start it with scripts/ci_services.sh"


@pytest.fixture(scope="session")
def docker_image() -> str:
    reason = docker_unreachable_reason()
    if reason:
        print(f"SKIP docker sandbox tests: {reason}")
        pytest.skip(reason)
    from vime_sandbox_docker.image import build_image
    from vime_sandbox_docker.sandbox import DEFAULT_IMAGE

    return build_image(DEFAULT_IMAGE)
