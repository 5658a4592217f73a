"""Contract of sandbox backends."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, ClassVar

import pytest

from vime_core.testing.contracts.base import _Contract


class SandboxBackendContract(_Contract):
    """Contract of ``vime_register_sandbox_backends`` providers (:class:`vime_core.sandbox.Sandbox` subclasses).

    Fixtures to supply:

    * ``sandbox_factory``: ``factory(**kwargs) -> Sandbox`` (not started; used as ``async with factory() as sb``),
      accepting the :class:`~vime_core.sandbox.Sandbox` keywords ``limits``, ``network`` and ``env``;
    * ``sandbox_exists``: ``fn(sandbox) -> bool``: whether any resource of that sandbox (process, container, VM,
      directory) still exists, asked of the backend's service directly, not of the object.

    Optional fixture ``sabotage``: ``async fn(sandbox)`` that destroys the sandbox behind vime's back (kills its
    VM, removes its container); without it the infrastructure-error test is skipped.

    Optional fixture ``sandbox_leftovers``: ``fn(sandbox_ids) -> {"containers": n, ...}``, what the backend's own
    listing (its service, ``/proc``, the filesystem) still holds of those sandboxes; with it the kit cancels
    :attr:`cancel_concurrency` concurrent lives at every await point of ``start``/``exec``/``close`` in turn
    (:mod:`vime_core.testing.sandbox_cancel`) and requires every count to be 0 after each round.

    Capabilities (see :data:`vime_core.sandbox.CAPABILITIES`): ``network_isolation``, ``resource_limits``,
    ``filesystem_isolation``, ``user``, ``detached``, ``wall_time``, ``reaper``, ``host_port``. The sandbox image
    must have ``/bin/sh``, coreutils, ``tar`` and ``python3``.
    """

    #: interfaces in ``/proc/net/dev`` of a sandbox without network; ``None`` skips that check (a VM keeps a
    #: restricted NIC for its SSH port forward). The outbound-connection check runs regardless.
    isolated_interfaces: ClassVar[set[str] | None] = {"lo"}
    #: sandboxes cancelled at once at each await point by the cancellation test
    cancel_concurrency: ClassVar[int] = 10

    @staticmethod
    def _run(coro: Any) -> Any:
        return asyncio.run(coro)

    @pytest.fixture
    def sabotage(self) -> Any:
        return None

    @pytest.fixture
    def sandbox_leftovers(self) -> Any:
        return None

    # -- registration and exec -----------------------------------------------------------------------------------
    def test_is_a_sandbox_class(self, sandbox_factory: Any) -> None:
        from vime_core.sandbox import Sandbox

        sb = sandbox_factory()
        assert isinstance(sb, Sandbox) and type(sb).NAME, "a backend subclasses vime_core.sandbox.Sandbox with NAME"
        assert sb.sandbox_id.startswith("vime-")

    def test_exec_exit_code_stdout_stderr(self, sandbox_factory: Any) -> None:
        async def body():
            async with sandbox_factory() as sb:
                r = await sb.exec("printf 'out\\n'; printf 'err\\n' >&2; exit 3", timeout=30)
                assert (r.exit_code, r.stdout, r.stderr, r.timed_out, r.truncated) == (
                    3,
                    "out\n",
                    "err\n",
                    False,
                    False,
                )
                ok = await sb.exec(["printf", "%s|", "a b", "c"], timeout=30)
                assert (ok.exit_code, ok.stdout, ok.ok) == (0, "a b|c|", True)
                assert (await sb.exec("kill -9 $$", timeout=30)).exit_code == 137

        self._run(body())

    def test_exec_env_cwd_stdin(self, sandbox_factory: Any) -> None:
        async def body():
            async with sandbox_factory(env={"BASE": "1"}) as sb:
                r = await sb.exec('printf "%s,%s" "$BASE" "$FOO"', env={"FOO": "bar baz"}, timeout=30)
                assert r.stdout == "1,bar baz"
                assert (await sb.exec("mkdir -p sub/dir", timeout=30)).exit_code == 0
                r = await sb.exec("pwd", cwd=f"{sb.workspace}/sub/dir", timeout=30)
                assert r.stdout == f"{sb.workspace}/sub/dir\n"
                assert (await sb.exec("pwd", timeout=30)).stdout == f"{sb.workspace}\n"
                blob = bytes(range(256)) * 1000
                r = await sb.exec("cat | wc -c", stdin=blob, timeout=30)
                assert r.stdout.strip() == str(len(blob))

        self._run(body())

    def test_exec_timeout(self, sandbox_factory: Any) -> None:
        import time

        from vime_core.sandbox import TIMEOUT_EXIT_CODE

        async def body():
            async with sandbox_factory() as sb:
                t0 = time.monotonic()
                r = await sb.exec("echo started; sleep 60", timeout=1.0)
                took = time.monotonic() - t0
                assert (r.timed_out, r.exit_code) == (True, TIMEOUT_EXIT_CODE)
                assert 0.9 <= took < 15, f"timeout of 1 s took {took:.1f} s"
                assert (await sb.exec("echo alive", timeout=30)).stdout == "alive\n"

        self._run(body())

    def test_output_flood_is_truncated(self, sandbox_factory: Any) -> None:
        async def body():
            async with sandbox_factory() as sb:
                r = await sb.exec(
                    "head -c 3000000 /dev/zero | tr '\\0' a; head -c 3000 /dev/zero | tr '\\0' b >&2",
                    timeout=60,
                    max_output_bytes=1000,
                )
                assert (r.exit_code, r.stdout, r.stdout_truncated) == (0, "a" * 1000, True)
                assert (r.stderr, r.stderr_truncated) == ("b" * 1000, True)
                r = await sb.exec("printf 12345", timeout=30, max_output_bytes=5)
                assert (r.stdout, r.stdout_truncated) == ("12345", False)

        self._run(body())

    def test_concurrent_execs(self, sandbox_factory: Any) -> None:
        async def body():
            async with sandbox_factory() as sb:
                rs = await asyncio.gather(*(sb.exec(f"sleep 0.2; echo {i}", timeout=60) for i in range(6)))
                assert [r.stdout for r in rs] == [f"{i}\n" for i in range(6)]

        self._run(body())

    # -- files ---------------------------------------------------------------------------------------------------
    def test_write_read_round_trip_is_byte_exact(self, sandbox_factory: Any) -> None:
        blob = bytes(range(256)) * 4096 + b"\x00\xff"

        async def body():
            async with sandbox_factory() as sb:
                await sb.write_file("nested/dir/data.bin", blob)
                assert await sb.read_file("nested/dir/data.bin") == blob
                assert await sb.read_file(f"{sb.workspace}/nested/dir/data.bin") == blob
                await sb.write_file("empty", b"")
                assert await sb.read_file("empty") == b""
                await sb.write_file("text.txt", "héllo\n")
                assert (await sb.exec("cat text.txt", timeout=30)).stdout == "héllo\n"
                await sb.exec("printf 'from inside' > made.txt", timeout=30)
                assert await sb.read_file("made.txt") == b"from inside"
                with pytest.raises(FileNotFoundError):
                    await sb.read_file("missing.txt")
                with pytest.raises(IsADirectoryError):
                    await sb.read_file("nested")

        self._run(body())

    def test_upload_download_dir(self, sandbox_factory: Any, tmp_path: Path) -> None:
        src = tmp_path / "src"
        (src / "a" / "b").mkdir(parents=True)
        (src / "top.txt").write_text("top\n")
        (src / "a" / "b" / "bin.dat").write_bytes(bytes(range(256)) * 10)
        (src / "a" / "empty").write_bytes(b"")

        async def body():
            async with sandbox_factory() as sb:
                await sb.upload_dir(src, "proj")
                r = await sb.exec("cat proj/top.txt; wc -c < proj/a/b/bin.dat", timeout=30)
                assert r.stdout.split() == ["top", "2560"]
                await sb.exec("echo new > proj/a/new.txt", timeout=30)
                await sb.download_dir("proj", tmp_path / "back")
                with pytest.raises(FileNotFoundError):
                    await sb.download_dir("no-such-dir", tmp_path / "none")

        self._run(body())
        back = tmp_path / "back"
        files = sorted(str(p.relative_to(back)) for p in back.rglob("*") if p.is_file())
        assert files == ["a/b/bin.dat", "a/empty", "a/new.txt", "top.txt"]
        assert (back / "a" / "b" / "bin.dat").read_bytes() == bytes(range(256)) * 10
        assert (back / "a" / "new.txt").read_text() == "new\n"

    def test_sandboxes_do_not_share_files(self, sandbox_factory: Any) -> None:
        async def body():
            async with sandbox_factory() as one, sandbox_factory() as two:
                await one.write_file("mine.txt", b"1")
                assert (await two.exec("test -e mine.txt", timeout=30)).exit_code != 0
                if "filesystem_isolation" in self.capabilities:  # a private /tmp too
                    await one.exec("echo x > /tmp/vime-shared-probe", timeout=30)
                    assert (await two.exec("test -e /tmp/vime-shared-probe", timeout=30)).exit_code != 0

        self._run(body())

    # -- isolation -----------------------------------------------------------------------------------------------
    _NET_PROBE = (
        "import socket\n"
        "try:\n"
        "    socket.create_connection(('1.1.1.1', 53), timeout=3)\n"
        "    print('connected')\n"
        "except OSError as e:\n"
        "    print('blocked', type(e).__name__)\n"
    )

    def test_network_off_by_default(self, sandbox_factory: Any) -> None:
        self.require("network_isolation")

        async def body():
            async with sandbox_factory() as sb:
                r = await sb.exec("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '", timeout=30)
                if self.isolated_interfaces is not None:
                    assert set(r.stdout.split()) == self.isolated_interfaces, f"interfaces: {r.stdout.split()}"
                r = await sb.exec(["python3", "-c", self._NET_PROBE], timeout=30)
                assert r.stdout.startswith("blocked"), r.stdout + r.stderr
            async with sandbox_factory(network=True) as sb:
                r = await sb.exec("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '", timeout=30)
                assert set(r.stdout.split()) - {"lo"}, "network=True gives the sandbox an interface besides lo"

        self._run(body())

    def test_cannot_write_outside_workspace(self, sandbox_factory: Any) -> None:
        self.require("filesystem_isolation")
        import os

        probe = "/etc/vime-sandbox-escape-probe"

        async def body():
            async with sandbox_factory() as sb:
                for target in (probe, "/usr/vime-escape", "/vime-escape"):
                    r = await sb.exec(f"echo x > {target}", timeout=30)
                    assert r.exit_code != 0, f"wrote {target}"
                with pytest.raises(PermissionError):
                    await sb.write_file(probe, b"x")
                assert (
                    await sb.exec("echo ok > inside.txt && echo ok > /tmp/t && cat inside.txt", timeout=30)
                ).stdout == "ok\n"
                assert (await sb.exec(f"test -e {probe}", timeout=30)).exit_code != 0

        self._run(body())
        assert not os.path.exists(probe)

    def test_resource_limits(self, sandbox_factory: Any) -> None:
        self.require("resource_limits")
        from vime_core.sandbox import SandboxLimits

        limits = SandboxLimits(memory_bytes=128 << 20, pids=32, disk_bytes=8 << 20, cpus=1.0)

        async def body():
            async with sandbox_factory(limits=limits) as sb:
                mem = await sb.exec(["python3", "-c", "b = bytearray(512 << 20); print('allocated')"], timeout=60)
                assert mem.exit_code != 0 and "allocated" not in mem.stdout, "512 MiB allocated under 128 MiB"
                big = await sb.exec("head -c 16000000 /dev/zero > big.bin", timeout=60)
                assert big.exit_code != 0, "16 MB file written under an 8 MB disk limit"
                forks = await sb.exec("for i in $(seq 1 64); do sleep 2 & done; wait", timeout=60)
                assert forks.exit_code != 0 or forks.stderr, "64 processes started under pids=32"
                assert (await sb.exec("echo still-usable", timeout=30)).stdout == "still-usable\n"

        self._run(body())

    def test_wall_time_limit_kills_everything(self, sandbox_factory: Any) -> None:
        self.require("wall_time")
        import time

        from vime_core.sandbox import SandboxExpiredError, SandboxLimits

        async def body():
            async with sandbox_factory(limits=SandboxLimits(wall_time_s=3.0)) as sb:
                t0 = time.monotonic()
                r = await sb.exec("sleep 60", timeout=60)
                assert r.timed_out and time.monotonic() - t0 < 20
                await asyncio.sleep(0.5)
                with pytest.raises(SandboxExpiredError):
                    await sb.exec("true", timeout=30)

        self._run(body())  # and the teardown after expiry does not raise

    def test_user(self, sandbox_factory: Any) -> None:
        self.require("user")

        async def body():
            async with sandbox_factory() as sb:
                assert (await sb.exec("id -u", user="nobody", timeout=30)).stdout == "65534\n"

        self._run(body())

    # -- detached commands ---------------------------------------------------------------------------------------
    def test_detached_start_poll_wait_kill(self, sandbox_factory: Any) -> None:
        self.require("detached")

        async def body():
            async with sandbox_factory() as sb:
                proc = await sb.start_detached(
                    "until [ -f go ]; do sleep 0.05; done; echo done; echo warn >&2; exit 4"
                )
                assert await sb.poll(proc) is None
                await sb.write_file("go", b"")
                r = await sb.wait(proc, timeout=60)
                assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (4, "done\n", "warn\n", False)
                long = await sb.start_detached("sleep 60")
                await sb.kill(long)
                r = await sb.wait(long, timeout=30)
                assert r.exit_code == 137
                limited = await sb.start_detached("sleep 60", timeout=1.0)
                r = await sb.wait(limited, timeout=30)
                assert (r.timed_out, r.exit_code) == (True, 137)

        self._run(body())

    # -- host port -----------------------------------------------------------------------------------------------
    _HTTP_GET = (
        "import sys, urllib.request\n"
        "try:\n"
        "    body = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode()\n"
        "    print('ok', body)\n"
        "except Exception as e:\n"
        "    print('failed', type(e).__name__)\n"
    )

    def test_expose_host_port(self, sandbox_factory: Any) -> None:
        """A host HTTP server on 127.0.0.1 answers a request made from inside the sandbox through
        ``expose_host_port``; with ``network_isolation``, another host port stays unreachable (capability
        ``"host_port"``)."""
        self.require("host_port")
        import http.server
        import threading

        def serve(body: bytes) -> http.server.ThreadingHTTPServer:
            class Handler(http.server.BaseHTTPRequestHandler):
                def do_GET(self) -> None:  # noqa: N802
                    payload = body + self.path.encode()
                    self.send_response(200)
                    self.send_header("content-length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)

                def log_message(self, *a: Any) -> None:
                    pass

            srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            return srv

        exposed, hidden = serve(b"exposed:"), serve(b"hidden:")
        port, other = exposed.server_address[1], hidden.server_address[1]

        async def body():
            async with sandbox_factory() as sb:
                addr = await sb.expose_host_port(port)
                assert await sb.expose_host_port(port) == addr, "exposing the same port twice gives one address"
                for path in ("/a", "/b/c"):
                    r = await sb.exec(["python3", "-c", self._HTTP_GET, f"http://{addr}{path}"], timeout=60)
                    assert r.stdout == f"ok exposed:{path}\n", r.stdout + r.stderr
                if "network_isolation" in self.capabilities:
                    host, _, _ = addr.rpartition(":")
                    r = await sb.exec(["python3", "-c", self._HTTP_GET, f"http://{host}:{other}/x"], timeout=60)
                    assert r.stdout.startswith("failed"), r.stdout + r.stderr
                    r = await sb.exec(["python3", "-c", self._NET_PROBE], timeout=30)
                    assert r.stdout.startswith("blocked"), r.stdout + r.stderr

        try:
            self._run(body())
        finally:
            exposed.shutdown()
            hidden.shutdown()

    # -- teardown ------------------------------------------------------------------------------------------------
    def test_teardown_on_exception(self, sandbox_factory: Any, sandbox_exists: Any) -> None:
        holder: list[Any] = []

        async def body():
            async with sandbox_factory() as sb:
                holder.append(sb)
                await sb.exec("sleep 60 > /dev/null 2>&1 &", timeout=30)
                assert sandbox_exists(sb)
                raise KeyError("boom")

        with pytest.raises(KeyError):
            self._run(body())
        assert not sandbox_exists(holder[0])

    def test_teardown_on_cancellation_and_timeout(self, sandbox_factory: Any, sandbox_exists: Any) -> None:
        from vime_core.sandbox import SandboxExpiredError

        holder: list[Any] = []
        started = asyncio.Event

        async def use(ev: asyncio.Event) -> None:
            sb = sandbox_factory()
            holder.append(sb)
            async with sb:
                ev.set()
                await sb.exec("sleep 60", timeout=120)

        async def body():
            ev = started()
            task = asyncio.ensure_future(use(ev))
            await asyncio.wait_for(ev.wait(), 120)
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            ev2 = started()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(use(ev2), timeout=4.0)

        self._run(body())
        assert len(holder) == 2
        for sb in holder:
            assert not sandbox_exists(sb), f"{sb.sandbox_id} survived cancellation"
            with pytest.raises(SandboxExpiredError):
                asyncio.run(sb.exec("true"))

    def test_cancellation_at_every_await_point_leaves_nothing(
        self, sandbox_factory: Any, sandbox_leftovers: Any
    ) -> None:
        """Cancelled at each await point of start/exec/close in turn (``cancel_concurrency`` sandboxes at once): the
        cancellation propagates (never swallowed, never stuck) and nothing of those sandboxes is left."""
        if sandbox_leftovers is None:
            pytest.skip(f"{type(self).__name__} supplies no `sandbox_leftovers` fixture")
        from vime_core.sandbox.base import forget_reaps
        from vime_core.testing.sandbox_cancel import cancel_at_every_await_point

        report = self._run(
            cancel_at_every_await_point(
                sandbox_factory, sandbox_leftovers, concurrency=self.cancel_concurrency, before_round=forget_reaps
            )
        )
        print(f"\n{type(self).__name__} cancellation: {report.summary()}")
        assert report.points >= 3, report.summary()  # at least one in each of start, exec and close
        # a point a concurrent life may pass without suspending (the shared reap already done) cancels no one
        assert sum(r.cancelled > 0 for r in report.rounds) >= 3, report.summary()
        assert not report.problems, report.summary()

    def test_infrastructure_failure_raises_infra_error(self, sandbox_factory: Any, sabotage: Any) -> None:
        if sabotage is None:
            pytest.skip(f"{type(self).__name__} supplies no `sabotage` fixture")
        from vime_core.sandbox import SandboxInfraError

        async def body():
            async with sandbox_factory() as sb:
                await sabotage(sb)
                with pytest.raises(SandboxInfraError):
                    await sb.exec("true", timeout=30)

        self._run(body())

    def test_reaper_spares_live_sandboxes(self, sandbox_factory: Any) -> None:
        self.require("reaper")

        async def body():
            async with sandbox_factory() as sb:
                report = await asyncio.to_thread(type(sb).cleanup)
                assert sb.sandbox_id not in report.removed
                assert (await sb.exec("echo alive", timeout=30)).stdout == "alive\n"

        self._run(body())
