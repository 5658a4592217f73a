"""Shared fixtures: the base VM image (built once if missing) and one VM shared by the tests of every file here
(``session_vm``), driven from an event loop on a thread of its own (tests reach it with :meth:`SessionVM.run`). It
boots when the first test that uses it starts (the files here run one after another on one xdist worker, in the
``memory-heavy`` unit) and shuts down after the last of them, so no idle VM costs CPU while other tests run. Tests
skip, printing the reason, only when QEMU or the image tools are missing."""

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


#: the fixture name of the shared VM
SESSION_VM = "session_vm"


class SharedVM:
    """The one :class:`SessionVM` of the session: booted by the first test that asks for it, closed after the last
    test of the session that uses it (:func:`pytest_runtest_teardown`)."""

    def __init__(self) -> None:
        self.vm: SessionVM | None = None
        self.failed: BaseException | None = None  # a failed boot fails the tests after it too, without booting again
        self.boots = 0
        self.last_user: int | None = None  # the index of the last test using the VM in the session's order

    def get(self, image_dir) -> SessionVM:
        if self.failed is not None:
            raise RuntimeError(f"the session VM did not boot: {self.failed!r}")
        if self.vm is None:
            from vime_core.sandbox import SandboxLimits

            limits = SandboxLimits(wall_time_s=None, pids=64, memory_bytes=512 << 20)
            try:
                self.vm = SessionVM(image_dir=image_dir, limits=limits)
            except BaseException as e:
                self.failed = e
                raise
            self.boots += 1
            print(f"\nsession VM booted in {self.vm.boot_s:.1f} s ({self.vm.sandbox._accel()}), boot {self.boots}")
        return self.vm

    def close(self) -> None:
        self.failed = None
        if self.vm is not None:
            vm, self.vm = self.vm, None
            vm.close()


SHARED_VM = SharedVM()


@pytest.fixture
def session_vm(vm_image) -> SessionVM:
    """The shared VM (:class:`SharedVM`): its sandbox, and ``run`` to drive it; tests leave it as they found it."""
    return SHARED_VM.get(vm_image)


def _last_user(items: list) -> int:
    """The index of the last test in ``items`` that uses the shared VM (-1 if none)."""
    return max((i for i, it in enumerate(items) if SESSION_VM in getattr(it, "fixturenames", ())), default=-1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test's own teardown: shut the shared VM down once no later test of this process uses it (the tests
    between, e.g. a contract test without a sandbox, run beside it)."""
    yield
    items = item.session.items
    if SHARED_VM.last_user is None:
        SHARED_VM.last_user = _last_user(items)
    if nextitem is None or items.index(item) >= SHARED_VM.last_user:
        SHARED_VM.close()


def pytest_sessionfinish(session) -> None:  # noqa: ARG001 - pytest's hook signature
    """An interrupted run leaves no VM either."""
    SHARED_VM.close()
