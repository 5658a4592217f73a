"""A weight version that cannot be written (``--update-weight-disk-dir`` on a full or read-only filesystem) fails
the step with an error naming the directory; no engine gets anything, so the engines stay on their version, no
partial file is left, and the trained step is checkpointed (nothing trained is lost).

Each case runs twice: on a real tiny tmpfs (a full one, a read-only one) when this process may mount one, and
with the OS error injected at the write call (``ENOSPC`` in the safetensors write, ``EROFS`` at ``mkdir``) so that
CI without mount rights covers the same path.
"""

from __future__ import annotations

import errno
import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support.async_rollout import async_run_args, sleeping_generate
from tests.support.rollout import manager_with_hooks
from vime_core.cli.arguments import default_args
from vime_core.config import RunConfig
from vime_core.plugins.manager import get_plugins
from vime_core.run.checkpoint_schedule import TRAINED_PROMPTS_FILE
from vime_core.run.failed_step import save_after_failed_write as _save_after_failed_write
from vime_core.run.preflight import trainer_classes
from vime_core.run.state import RunState
from vime_core.run.step import one_step as _one_step
from vime_core.run.step_source import GroupSource as _GroupSource
from vime_core.trainer.group import TrainerWorker
from vime_core.weight_sync.base import WeightWriteError
from vime_core.weight_sync.disk import DiskWeightSync
from vime_core.weight_sync.disk_delta import DiskDeltaWeightSync

pytestmark = pytest.mark.unit

FULL = "No space left on device"
READ_ONLY = "Read-only file system"


def _mount(path: Path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return (
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode
        == 0
    )


@pytest.fixture(params=["tmpfs", "injected"])
def broken_dir(request, tmp_path, monkeypatch):
    """``(make, how)``: ``make(kind)`` returns a weight directory that is full (``kind="full"``) or read-only."""
    mounted: list[Path] = []

    def make(kind: str) -> Path:
        path = tmp_path / f"w_{kind}"
        if request.param == "tmpfs":
            if not _mount(path, "size=64k" if kind == "full" else "ro,size=64k"):
                pytest.skip("this process may not mount a tmpfs")
            mounted.append(path)
            return path
        path.mkdir()
        if kind == "full":

            def no_space(tensors, filename, metadata=None):
                Path(filename).write_bytes(b"\0" * 10)  # a partial file, as a real full disk leaves
                raise OSError(errno.ENOSPC, FULL, filename)

            monkeypatch.setattr("vime_core.weight_sync.disk.save_file", no_space)
            monkeypatch.setattr("safetensors.numpy.save_file", no_space)
        else:
            real_mkdir = Path.mkdir

            def read_only(self, *a, **k):
                if str(self).startswith(str(path)):
                    raise OSError(errno.EROFS, READ_ONLY, str(self))
                return real_mkdir(self, *a, **k)

            monkeypatch.setattr(Path, "mkdir", read_only)
        return path

    yield make, request.param
    for path in mounted:
        subprocess.run(["umount", str(path)], check=True)


def _tensors():
    return [("w", torch.arange(100_000, dtype=torch.float32))]  # 400 kB: more than the 64 kB tmpfs holds


@pytest.mark.parametrize("kind", ["full", "read-only"])
@pytest.mark.parametrize("strategy", [DiskWeightSync, DiskDeltaWeightSync])
def test_a_failed_write_names_the_directory_and_leaves_nothing(broken_dir, tmp_path, kind, strategy):
    make, how = broken_dir
    d = make(kind)
    args = default_args(update_weight_disk_dir=d, keep_weight_updates=False)
    sync = strategy(RunConfig.from_args(args))
    if isinstance(sync, DiskDeltaWeightSync):
        sync.seed(iter(_tensors()), 0)  # the engines hold version 0
    with pytest.raises(WeightWriteError) as e:
        new = torch.randn(100_000, generator=torch.Generator().manual_seed(0))  # a delta zstd cannot shrink
        sync.push(iter([("w", new)]), 1)
    msg = str(e.value)
    assert msg.startswith(f"--update-weight-disk-dir {d}: cannot write weight version directory weight_v000001: ")
    assert (FULL if kind == "full" else READ_ONLY) in msg and msg.endswith("the engines keep their current weights")
    assert not list(d.iterdir())  # no partial weight_v000001.tmp holds the space
    if isinstance(sync, DiskDeltaWeightSync):
        assert sync.version == 0  # the next delta is still computed against what the engines hold


def test_the_step_fails_the_engines_keep_their_version_and_the_training_is_checkpointed(
    broken_dir, tiny_model_dir, tmp_path
):
    make, _ = broken_dir
    weights = make("full")
    args, overrides = async_run_args(tiny_model_dir, tmp_path, loop="sync", rollout_batch_size=2, weight_sync="disk")
    args.update_weight_disk_dir = weights
    box: dict = {}
    m = manager_with_hooks(tiny_model_dir, tmp_path, generate=sleeping_generate(box), num_prompts=4, **overrides)
    box["m"] = m
    cfg = RunConfig.from_args(args)
    trainer = TrainerWorker(cfg, tiny_model_dir, trainer_classes(get_plugins(), cfg))
    estimator = get_plugins().resolve("advantage", args.advantage_estimator)
    source = _GroupSource(args, m)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        with pytest.raises(WeightWriteError) as e:
            _one_step(RunConfig.from_args(args), 0, source, m, trainer, estimator, 0)
        assert m.weight_version == 0  # nothing reached the engines
        run = RunState(args, None, args, out, trainer, None, source, step=0, version=0)  # args carry the log flags
        error = _save_after_failed_write(run, e.value)
    finally:
        m.shutdown()
    ckpt = out / "checkpoints" / "step_000001"
    assert str(error) == f"step 1: {e.value}; the trained step is saved in {ckpt} (a re-run resumes it)"
    assert json.loads((ckpt / "meta.json").read_text()) == {"step": 1, "weight_version": 1}
    assert [json.loads(x) for x in (out / TRAINED_PROMPTS_FILE).read_text().splitlines()] == [
        {"step": 0, "prompt_index": [0, 1], "group_index": [0, 1]}
    ]
    state = torch.load(ckpt / "trainer" / "trainer_state.pt", weights_only=False)
    assert state["steps_done"] == 1  # the checkpoint holds the trained step, not what the engines serve


def test_a_read_only_weight_dir_fails_the_startup_check_naming_it(broken_dir):
    make, _ = broken_dir
    d = make("read-only")
    with pytest.raises(WeightWriteError, match=rf"^--update-weight-disk-dir {d}: cannot write there \(Read-only file"):
        TrainerWorker.write_nonce(None, str(d), "0123")


def test_the_cli_prints_the_actor_error_without_ray_traceback(monkeypatch, capsys):
    """A WeightWriteError raised in a Ray actor reaches the driver as Ray's task error (an instance of both): the
    CLI prints the actor's message, not Ray's traceback, and exits with 2."""
    from ray.exceptions import RayTaskError

    from vime_core.cli import commands as cli

    cause = WeightWriteError("--update-weight-disk-dir /w: cannot write there (Read-only file system)")
    remote = RayTaskError("TrainerWorker.write_nonce", "Traceback (most recent call last): ...", cause)
    remote = remote.as_instanceof_cause()
    assert isinstance(remote, WeightWriteError) and str(remote) != str(cause)  # Ray's text, not the message

    def run(argv):
        raise remote

    monkeypatch.setitem(cli.COMMANDS, "run", run)
    assert cli.main(["run"]) == 2
    assert capsys.readouterr().err == f"vime: error: {cause}\n"
