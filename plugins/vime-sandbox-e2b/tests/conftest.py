"""The fake E2B service (REST API + envd on 127.0.0.1, :mod:`vime_sandbox_e2b.testing`), one per test session, and
the SDK environment pointing at it (set per test, so that nothing else sees the fake's key)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def fake_e2b():
    from vime_sandbox_e2b.testing import FakeE2B

    with FakeE2B() as fake:
        yield fake


@pytest.fixture
def e2b_env(fake_e2b, monkeypatch):
    for key, value in fake_e2b.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("E2B_DOMAIN", raising=False)
    return fake_e2b
