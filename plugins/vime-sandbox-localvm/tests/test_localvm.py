"""vime-sandbox-localvm on real QEMU VMs: isolation of a booted VM, the contract kit over SSH on that VM (attach
mode), the wall-time limit, and a SIGKILL leak test. Boots are few (software emulation is slow): marked ``slow``,
since every boot takes one to two minutes without KVM."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from vime_sandbox_localvm.sandbox import LocalVMSandbox, leftover_counts

from vime_core.sandbox import SandboxExpiredError, SandboxLimits
from vime_core.testing import SandboxBackendContract
from vime_core.testing.sandbox_leak import run_once, spawn_and_kill

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_booted_vm_is_isolated(session_vm, tmp_path):
    sb, run = session_vm.sandbox, session_vm.run
    marker = tmp_path / "host-file"
    marker.write_text("host")
    probe = (
        "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=3)\n    print('connected')\n"
        "except OSError as e:\n    print('blocked', type(e).__name__)\n"
    )
    net = run(sb.exec(["python3", "-c", probe], timeout=120))
    assert net.stdout.startswith("blocked"), net
    etc = run(sb.exec("echo x > /etc/escape; echo x > /escape", timeout=120))
    assert etc.exit_code != 0 and "Read-only" in etc.stderr
    remount = run(sb.exec("mount -o remount,rw /", timeout=120))
    assert remount.exit_code != 0
    host = run(sb.exec(f"cat {marker} 2>&1; echo y > {marker}", timeout=120))
    assert marker.read_text() == "host", host
    assert run(sb.exec("id -u", user="nobody", timeout=120)).stdout == "65534\n"
    # 100 processes alive at once, whatever the machine's load: each child reads a FIFO that gets its EOF only when the
    # shell (``sh``) closes its end, after the loop or when it exits on a failed fork (``sleep 3`` children, as before,
    # ended before the 64th started when TCG forked slowly, and the test saw no limit)
    fifo_forks = (
        'f=/tmp/forks.fifo; mkfifo "$f"; exec 3<>"$f"; '
        'for i in $(seq 1 100); do (exec 3>&-; read x < "$f") & done; exec 3>&-; wait; rm -f "$f"'
    )
    forks = run(sb.exec(fifo_forks, timeout=300))
    assert forks.exit_code != 0 or "fork" in forks.stderr, ("100 processes under pids=64", forks)
    ws = run(sb.exec("echo ok > f && cat f && pwd", timeout=120))
    assert ws.stdout == "ok\n/workspace\n"
    print(
        f"\nVM isolation: network {net.stdout.strip()}; write /etc rc={etc.exit_code}; remount rc="
        f"{remount.exit_code}; host file untouched; pids limit: {forks.stderr.strip()[:80]!r}"
    )


@pytest.mark.contract
class TestLocalVMAttached(SandboxBackendContract):
    """The contract over SSH against the session VM, in attach mode (a fresh workspace per sandbox)."""

    capabilities = {"detached"}

    @pytest.fixture
    def sandbox_factory(self, session_vm, vm_image):
        addr = f"root@127.0.0.1:{session_vm.sandbox.port}"
        return lambda **kw: LocalVMSandbox(image_dir=vm_image, ssh=addr, **kw)

    @pytest.fixture
    def sandbox_exists(self, session_vm):
        def exists(sb: LocalVMSandbox) -> bool:
            r = session_vm.run(
                session_vm.sandbox.exec(
                    f"test -e {sb.workspace} && echo dir; grep -lz 'VIME_SANDBOX_ID={sb.sandbox_id}' "
                    f"/proc/[0-9]*/environ 2>/dev/null | grep -v self || true",
                    timeout=120,
                )
            )
            return bool(r.stdout.strip())

        return exists


def test_multi_turn_generate_runs_code_in_the_vm(session_vm, vm_image, tmp_path):
    """``--generate multi_turn --multi-turn-sandbox-tool bash --sandbox localvm``: the real generate function (engine
    scripted) runs the model's code over SSH in the session VM (attach mode, ``--sandbox-localvm-ssh``: no extra
    boot); a call at ``--multi-turn-tool-timeout`` is killed in the VM and the model sees its partial output."""
    import json

    from transformers import AutoTokenizer

    from vime_core.agent.responders import ScriptedResponder
    from vime_core.plugins.manager import get_plugins
    from vime_core.rollout.context import RolloutContext, set_rollout_context
    from vime_core.testing.plugin_context import plugin_context_from_argv
    from vime_core.testing.tiny_model import build_tiny_model
    from vime_core.types import Sample, Status

    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "tiny", seed=0))
    args = plugin_context_from_argv(
        [
            "--model",
            "unused",
            "--generate",
            "multi_turn",
            "--multi-turn-sandbox-tool",
            "bash",
            "--sandbox",
            "localvm",
            "--sandbox-localvm-ssh",
            f"root@127.0.0.1:{session_vm.sandbox.port}",
            "--sandbox-localvm-image-dir",
            str(vm_image),
            "--multi-turn-tool-timeout",
            "5",
            "--multi-turn-tools",
        ]
    )

    def call(command: str) -> str:
        return f"<tool_call>\n{json.dumps({'name': 'bash', 'arguments': {'command': command}})}\n</tool_call>"

    count = "find /var/tmp/vime-workspaces /tmp/vime-workspaces -mindepth 1 -maxdepth 1 2>/dev/null | wc -l"
    before = session_vm.run(session_vm.sandbox.exec(count, timeout=120)).stdout
    backend = ScriptedResponder(
        tok, [call("python3 -c 'print(6*7)' > out.txt; cat out.txt"), call("echo partial; sleep 60"), "done"]
    )
    set_rollout_context(RolloutContext(client=backend, tokenizer=tok, weight_version=0))
    try:
        generate = get_plugins().resolve("generate", "multi_turn")
        s = asyncio.run(generate(args, Sample(prompt="Compute it."), {"temperature": 1.0, "max_tokens": 512}))
    finally:
        set_rollout_context(None)
    assert (s.status, s.metadata["num_turns"]) == (Status.COMPLETED, 3)
    results = [c["result"] for c in s.metadata["tool_calls"]]
    assert results == ["exit code: 0\nstdout:\n42\n", "exit code: 137 (timed out)\nstdout:\npartial\n"]
    after = session_vm.run(session_vm.sandbox.exec(count, timeout=120)).stdout
    assert after == before, "the episode's workspace in the VM was not removed"


@pytest.mark.extended
def test_wall_time_limit_kills_the_vm(vm_image):
    async def body():
        sb = LocalVMSandbox(image_dir=vm_image, limits=SandboxLimits(wall_time_s=20, memory_bytes=256 << 20))
        async with sb:
            t0 = time.monotonic()
            r = await sb.exec("sleep 600", timeout=600)
            took = time.monotonic() - t0
            assert r.timed_out and took < 60, (r, took)
            await asyncio.sleep(0.5)
            with pytest.raises(SandboxExpiredError):
                await sb.exec("true", timeout=30)
            assert sb._qemu.returncode is not None
        assert not sb.directory.exists()
        return took

    took = asyncio.run(body())
    print(f"\nwall-time limit 20 s: command killed after {took:.1f} s, VM gone, overlay deleted")


@pytest.mark.extended
@pytest.mark.exclusive  # counts every process's VMs
def test_sigkill_mid_command_leaves_no_vm_after_the_reaper(vm_image):
    n = int(os.environ.get("VIME_LOCALVM_LEAK_N", "20" if _kvm(vm_image) else "2"))
    before = leftover_counts()  # the session VM, if it is up, belongs to this live process and must survive
    ready_s = spawn_and_kill("localvm", n, timeout_s=1800, memory_mb=256)
    killed = {k: v - before[k] for k, v in leftover_counts().items()}
    run_once("localvm", timeout_s=1800)
    after = {k: v - before[k] for k, v in leftover_counts().items()}
    print(
        f"\nlocalvm leak test ({n} VMs, ready in {ready_s:.0f} s): after SIGKILL {killed}; after the next sandbox "
        f"start {after} (counts beyond the {before} of this live test process)"
    )
    assert killed["directories"] == n
    assert after == {"vms": 0, "directories": 0}


@pytest.mark.extended
def test_cancellation_at_every_await_point_leaves_no_vm(vm_image):
    """Booted VMs cancelled at each await point of start/exec/close in turn (10 at once with KVM, 2 under TCG): no
    QEMU process and no overlay directory of theirs is left (the kit's generic harness)."""
    from vime_core.sandbox.base import forget_reaps
    from vime_core.testing.sandbox_cancel import cancel_at_every_await_point

    n = int(os.environ.get("VIME_LOCALVM_CANCEL_N", "10" if _kvm(vm_image) else "2"))
    factory = lambda: LocalVMSandbox(image_dir=vm_image, limits=SandboxLimits(memory_bytes=256 << 20))  # noqa: E731
    report = asyncio.run(
        cancel_at_every_await_point(
            factory,
            lambda ids: leftover_counts(ids=ids),
            concurrency=n,
            before_round=forget_reaps,
            finish_timeout_s=600,
        )
    )
    print(f"\nlocalvm cancellation ({n} VMs at once): {report.summary()}")
    assert report.points >= 3 and sum(r.cancelled > 0 for r in report.rounds) >= 3, report.summary()
    assert not report.problems, report.summary()


def _kvm(image_dir) -> bool:
    from vime_sandbox_localvm.sandbox import kvm_boots

    return kvm_boots(image_dir)
