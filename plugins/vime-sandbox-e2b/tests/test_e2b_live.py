"""vime-sandbox-e2b against the real E2B service: runs only when E2B_API_KEY is set (skipped, with the reason
printed, otherwise). Template: VIME_E2B_TEMPLATE or ``base``."""

from __future__ import annotations

import os

import pytest
from vime_sandbox_e2b.sandbox import E2BSandbox

from vime_core.testing import SandboxBackendContract

LIVE_REASON = None if os.environ.get("E2B_API_KEY") else "E2B_API_KEY is not set: no live E2B tests"
if LIVE_REASON:
    print(f"SKIP vime-sandbox-e2b live tests: {LIVE_REASON}")

pytestmark = [pytest.mark.integration, pytest.mark.skipif(LIVE_REASON is not None, reason=str(LIVE_REASON))]


class TestE2BLive(SandboxBackendContract):
    capabilities = set(E2BSandbox.capabilities)
    isolated_interfaces = None

    @pytest.fixture
    def sandbox_factory(self):
        template = os.environ.get("VIME_E2B_TEMPLATE", "base")
        return lambda **kw: E2BSandbox(template=template, **kw)

    @pytest.fixture
    def sandbox_exists(self):
        from e2b import Sandbox as SyncSandbox
        from e2b import SandboxQuery

        def exists(sb: E2BSandbox) -> bool:
            pager = SyncSandbox.list(query=SandboxQuery(metadata={"vime.sandbox": sb.sandbox_id}))
            return bool(pager.next_items())

        return exists
