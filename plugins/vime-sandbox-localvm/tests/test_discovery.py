"""vime-sandbox-localvm is found through its entry point, with its flags; no VM needed."""

import pytest
from vime_sandbox_localvm.sandbox import LocalVMSandbox

from vime_core.plugins.manager import get_plugins

pytestmark = pytest.mark.contract


def _ctx(argv: list[str]):
    """The plugin context of ``vime run --model m ARGV`` (every other flag at its default)."""
    from vime_core.testing.plugin_context import plugin_context_from_argv

    return plugin_context_from_argv(["--model", "m", *argv])


def test_plugin_is_discovered():
    rows = {r["name"]: r for r in get_plugins().describe()}
    assert rows["sandbox-localvm"]["distribution"] == "vime-sandbox-localvm"
    assert rows["sandbox-localvm"]["provides"] == {"sandbox": ["localvm"], "flags": ["sandbox-localvm"]}
    assert get_plugins().resolve("sandbox", "localvm") is LocalVMSandbox


def test_flags_reach_from_args(tmp_path):
    ctx = _ctx(
        [
            "--sandbox-localvm-image-dir",
            str(tmp_path),
            "--sandbox-localvm-accel",
            "tcg",
            "--sandbox-cpus",
            "2",
            "--sandbox-memory-mb",
            "512",
        ]
    )
    sb = LocalVMSandbox.from_context(ctx)
    assert (sb.image_dir, sb.accel, sb.ssh, sb.limits.cpus, sb.limits.memory_bytes) == (
        tmp_path,
        "tcg",
        None,
        2.0,
        512 << 20,
    )
    argv = sb._qemu_argv(2222)
    assert argv[argv.index("-smp") + 1] == "2" and argv[argv.index("-m") + 1] == "512"
    assert "user,id=n0,restrict=on,hostfwd=tcp:127.0.0.1:2222-:22" in argv
    attached = LocalVMSandbox.from_context(ctx, ssh="root@127.0.0.1:2200")
    assert attached.capabilities == {"detached"}


def test_missing_image_is_an_infra_error(tmp_path):
    import asyncio

    from vime_core.sandbox import SandboxInfraError

    async def body():
        async with LocalVMSandbox(image_dir=tmp_path / "none"):
            pass

    with pytest.raises(SandboxInfraError, match="build-image"):
        asyncio.run(body())


def _image(tmp_path, fmt):
    d = tmp_path / f"image-{fmt}"
    d.mkdir()
    manifest = {"suite": "bookworm"} if fmt == 1 else {"suite": "bookworm", "format": fmt}
    (d / "manifest.json").write_text(__import__("json").dumps(manifest))
    return d


def test_agents_share_in_the_qemu_command(tmp_path):
    """The prepared-agents directory becomes a read-only 9p device (tag ``vimeagents``) and ``vime.agents=1`` on the
    kernel command line only for images of format ≥ 2; no directory, ``agents_dir=False`` or an old image: none."""
    from vime_sandbox_localvm.image import IMAGE_FORMAT, image_format

    from vime_core.sandbox.base import SandboxInfraError

    agents = tmp_path / "agents"
    agents.mkdir()
    new, old = _image(tmp_path, IMAGE_FORMAT), _image(tmp_path, 1)
    assert (image_format(new), image_format(old), image_format(tmp_path / "none")) == (IMAGE_FORMAT, 1, 0)

    def argv(**kw):
        sb = LocalVMSandbox(accel="tcg", **kw)
        return sb._qemu_argv(2222)

    a = argv(image_dir=new, agents_dir=agents)
    i = a.index("-fsdev")
    assert a[i : i + 4] == [
        "-fsdev",
        f"local,id=agents,path={agents},security_model=none,readonly=on",
        "-device",
        "virtio-9p-pci,fsdev=agents,mount_tag=vimeagents",
    ]
    assert a[a.index("-append") + 1].endswith(" vime.agents=1")
    for kw in (
        {"image_dir": new, "agents_dir": False},
        {"image_dir": new, "agents_dir": tmp_path / "missing"},
        {"image_dir": old, "agents_dir": agents},
    ):
        b = argv(**kw)
        assert "-fsdev" not in b and b[b.index("-append") + 1].endswith(" vime.agents=0"), kw
    comma = tmp_path / "a,b"
    comma.mkdir()
    with pytest.raises(SandboxInfraError, match="comma"):
        argv(image_dir=new, agents_dir=comma)
