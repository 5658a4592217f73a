"""Shared fixtures: the base VM image (built once if missing) and one VM booted for the whole session, driven from
an event loop on a thread of its own (tests reach it with :meth:`SessionVM.run`). Tests skip, printing the reason,
only when QEMU or the image tools are missing."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time

import pytest


def localvm_unavailable_reason() -> str | None:
    missing = [t for t in ("qemu-system-x86_64", "qemu-img") if not shutil.which(t)]
    return f"missing {', '.join(missing)} (apt-get install qemu-system-x86 qemu-utils)" if missing else None


class SessionVM:
    """A :class:`LocalVMSandbox` started on a private event loop thread."""

    def __init__(self, **kwargs) -> None:
        from vime_sandbox_localvm.sandbox import LocalVMSandbox

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="session-vm")
        self.thread.start()
        self.sandbox = LocalVMSandbox(**kwargs)
        t0 = time.monotonic()
        self.run(self.sandbox.start(), timeout=1200)
        self.boot_s = time.monotonic() - t0

    def run(self, coro, timeout: float = 600):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        try:
            self.run(self.sandbox.close(), timeout=120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)


@pytest.fixture(scope="session")
def vm_image():
    reason = localvm_unavailable_reason()
    if reason:
        print(f"SKIP localvm tests: {reason}")
        pytest.skip(reason)
    from vime_sandbox_localvm.image import build_vm_image

    return build_vm_image()


@pytest.fixture(scope="module")  # only test_localvm.py uses it: an idle TCG VM costs a fifth of a core while it lives
def session_vm(vm_image):
    from vime_core.sandbox import SandboxLimits

    vm = SessionVM(image_dir=vm_image, limits=SandboxLimits(wall_time_s=None, pids=64, memory_bytes=512 << 20))
    print(f"\nsession VM booted in {vm.boot_s:.1f} s ({vm.sandbox._accel()})")
    yield vm
    vm.close()
