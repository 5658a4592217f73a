"""vime-sandbox-modal against the real Modal service: runs only when MODAL_TOKEN_ID and MODAL_TOKEN_SECRET are set
(skipped, with the reason printed, otherwise). Image: VIME_MODAL_IMAGE or ``python:3.12-slim``."""

from __future__ import annotations

import os

import pytest
from vime_sandbox_modal.sandbox import ModalSandbox

from vime_core.testing import SandboxBackendContract

LIVE_REASON = (
    None
    if os.environ.get("MODAL_TOKEN_ID") and os.environ.get("MODAL_TOKEN_SECRET")
    else "MODAL_TOKEN_ID/MODAL_TOKEN_SECRET are not set: no live Modal tests"
)
if LIVE_REASON:
    print(f"SKIP vime-sandbox-modal live tests: {LIVE_REASON}")

pytestmark = [pytest.mark.integration, pytest.mark.skipif(LIVE_REASON is not None, reason=str(LIVE_REASON))]


class TestModalLive(SandboxBackendContract):
    capabilities = set(ModalSandbox.capabilities)
    isolated_interfaces = None

    @pytest.fixture
    def sandbox_factory(self):
        image = os.environ.get("VIME_MODAL_IMAGE", "python:3.12-slim")
        return lambda **kw: ModalSandbox(image=image, **kw)

    @pytest.fixture
    def sandbox_exists(self):
        import modal

        def exists(sb: ModalSandbox) -> bool:
            app = modal.App.lookup(sb.app_name, create_if_missing=True)
            return any(True for _ in modal.Sandbox.list(app_id=app.app_id, tags={"vime.sandbox": sb.sandbox_id}))

        return exists
