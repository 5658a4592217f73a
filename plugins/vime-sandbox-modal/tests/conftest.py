"""The fake Modal service (control plane + task command router over gRPC on 127.0.0.1,
:mod:`vime_sandbox_modal.testing`), one per test session, and the SDK environment pointing at it (set per test)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def fake_modal():
    from vime_sandbox_modal.testing import FakeModal

    with FakeModal() as fake:
        yield fake


@pytest.fixture
def modal_env(fake_modal, monkeypatch):
    for key, value in fake_modal.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MODAL_PROFILE", raising=False)
    return fake_modal
