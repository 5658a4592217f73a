"""The built-in ``local`` sandbox backend against the sandbox contract kit (real subprocesses and namespaces)."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from vime_core.plugins.manager import get_plugins
from vime_core.sandbox.local import LocalSandbox, _pids_with_env, host_capabilities, host_mode, leftover_counts
from vime_core.testing import SandboxBackendContract

pytestmark = pytest.mark.contract


def test_local_is_registered_as_builtin():
    entry = next(e for e in get_plugins().registries["sandbox"].entries() if e.name == "local")
    assert entry.obj is LocalSandbox and entry.provider == "vime_core.builtins.sandboxes"


def test_host_mode_is_reported():
    mode = host_mode()
    print(f"local sandbox mode: {mode['mode']} cgroup={mode['cgroup']} {mode['reason']}")
    if os.geteuid() == 0 and not os.environ.get("VIME_SANDBOX_LOCAL_MODE"):
        assert mode["mode"] == "namespaces", mode["reason"]


class TestLocalSandbox(SandboxBackendContract):
    capabilities = set(host_capabilities())

    @pytest.fixture
    def sandbox_factory(self):
        return lambda **kw: LocalSandbox(**kw)

    @pytest.fixture
    def sandbox_exists(self):
        def exists(sb: LocalSandbox) -> bool:
            return sb.directory.exists() or bool(_pids_with_env({sb.sandbox_id}))

        return exists

    @pytest.fixture
    def sandbox_leftovers(self):
        return lambda ids: leftover_counts(ids=ids)  # processes (by environment), directories, cgroups

    @pytest.fixture
    def sabotage(self):
        async def kill_init(sb: LocalSandbox) -> None:
            if sb.mode == "namespaces":
                for pid in (sb._meta["init_pid"], sb._meta["holder_pid"]):
                    # killing init can end the namespace holder first: a pid already gone is what we want
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            else:
                pytest.skip("process-group mode has no init process to kill")

        return kill_init
