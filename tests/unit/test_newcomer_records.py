"""No command overwrites a finished run's records (issue 35, part 2), with the exact files before and after: a
finished run is recognised before anything starts and said so in one line; the logs of earlier invocations are
rotated; ``--no-resume`` (and a second ``vime eval``) moves the earlier records to ``OUTPUT_DIR/previous/N/``; a
resumed run's summary covers the whole run; only the checkpoints a resume needs are kept by default; exports are
readable as the other outputs are."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vime_core.cli.arguments import ArgumentError, default_args, parse_run_args
from vime_core.config import RunConfig
from vime_core.run.checkpoint import checkpoint_root, commit_checkpoint, new_checkpoint_dir
from vime_core.run.checkpoint_schedule import roll_back_records, save_checkpoint
from vime_core.run.output_dir import archive_records, finished_run, rotate_logs, share_like_outputs
from vime_core.run.preflight import preflight
from vime_core.run.summary import completed_summary

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path → sha256 of its bytes)."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _finished(out: Path, steps: int, *, checkpoint: bool = True, status: str = "completed") -> Path:
    """A run directory as a finished ``vime run`` leaves it (the files that matter here)."""
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "router.log").write_text("router of the training run\n")
    (out / "logs" / "vllm_engine_0.log").write_text("engine of the training run\n")
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "rollout/reward_mean": 0.5}) + "\n"
                                               for s in range(steps)))  # fmt: skip
    (out / "summary.json").write_text(json.dumps({"status": status, "steps_run": steps, "reward_last": 0.5}))
    (out / "args.json").write_text("{}")
    if checkpoint:
        ckpt = out / "checkpoints" / f"step_{steps:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "meta.json").write_text(json.dumps({"step": steps, "weight_version": steps}))
        (out / "checkpoints" / "latest").write_text(ckpt.name)
    return out


def test_a_finished_run_is_recognised_with_how_to_go_on(tmp_path):
    out = _finished(tmp_path / "run", 10)
    assert finished_run(out, 10) == (
        f"vime run: nothing to do: --output-dir {out} holds a finished run of 10 step(s) (--num-rollout 10; "
        "checkpoints/step_000010). To train on, raise --num-rollout (it resumes from step 10); to start over, add "
        f"--no-resume (the finished run's files move to {out}/previous/1/) or give another --output-dir"
    )
    assert finished_run(out, 5) is not None  # fewer steps asked than the run has: nothing to do either
    assert finished_run(out, 12) is None  # more steps: the run resumes from step 10
    assert finished_run(_finished(tmp_path / "failed", 10, status="failed"), 10) is None  # it resumes
    assert finished_run(tmp_path / "none", 10) is None


def test_a_finished_run_without_a_checkpoint_cannot_be_continued_and_says_so(tmp_path):
    out = _finished(tmp_path / "rollout_only", 2, checkpoint=False)  # --debug-rollout-only saves none
    assert finished_run(out, 2) == (
        f"vime run: nothing to do: --output-dir {out} holds a finished run (2 step(s); summary.json). To run it "
        f"again, add --no-resume (the finished run's files move to {out}/previous/1/) or give another --output-dir"
    )
    with pytest.raises(ArgumentError) as e:
        finished_run(out, 3)
    assert str(e.value) == (
        f"--output-dir {out} holds a finished run of 2 step(s) without a checkpoint to resume from, so "
        f"--num-rollout 3 cannot continue it: to start over, add --no-resume (the finished run's files move to "
        f"{out}/previous/1/) or give another --output-dir"
    )


PROBE = """
import sys
from vime_core.cli.commands import main
code = main(sys.argv[1:])
print("exit", code, sorted(m for m in ("torch", "transformers", "vllm", "ray") if m in sys.modules))
"""


def test_vime_run_on_a_finished_run_says_so_in_one_line_and_changes_nothing(tmp_path):
    """Through the ``vime`` command: nothing heavy is imported, no file of the run changes (the model need not
    exist: nothing is checked or started for a run that has nothing to do)."""
    out = _finished(tmp_path / "run", 2)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "p", "label": "1"}\n')
    before = _tree(out)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    argv = ["run", "--model", "/no/model", "--prompt-data", str(prompts), "--output-dir", str(out),
            "--num-rollout", "2"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, timeout=120)
    assert proc.stdout.splitlines() == [finished_run(out, 2), "exit 0 []"], proc.stderr[-2000:]
    assert proc.stderr == ""
    assert _tree(out) == before and not (out / ".vime.lock").exists()


def test_logs_of_earlier_invocations_are_rotated_never_overwritten(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    for name, text in (("router.log", "r-new"), ("router.1.log", "r-old"), ("vllm_engine_0.log", "e-new"),
                       ("vllm_engine_0.exit1.log", "crash"), ("health_events.jsonl", "{}")):  # fmt: skip
        (logs / name).write_text(text)
    moved = rotate_logs(logs)
    assert sorted(p.name for p in moved) == ["health_events.1.jsonl", "router.1.log", "vllm_engine_0.1.log",
                                            "vllm_engine_0.exit1.1.log"]  # fmt: skip
    assert {p.name: p.read_text() for p in logs.iterdir()} == {
        "router.1.log": "r-new",
        "router.2.log": "r-old",
        "vllm_engine_0.1.log": "e-new",
        "vllm_engine_0.exit1.1.log": "crash",
        "health_events.1.jsonl": "{}",
    }
    assert rotate_logs(logs) == [] and rotate_logs(tmp_path / "none") == []


def test_no_resume_moves_the_earlier_runs_records_and_leaves_the_rest(tmp_path):
    out = _finished(tmp_path / "run", 2)
    (out / "notes.txt").write_text("mine")  # not a record of vime's: stays
    before = _tree(out)
    assert archive_records(out) == out / "previous" / "1"
    after = _tree(out)
    assert after == {"notes.txt": before["notes.txt"]} | {
        f"previous/1/{name}": digest for name, digest in before.items() if name != "notes.txt"
    }
    _finished(out / "again", 1)
    for name in ("logs", "metrics.jsonl", "summary.json", "args.json", "checkpoints"):
        os.replace(out / "again" / name, out / name)
    assert archive_records(out) == out / "previous" / "2"
    assert archive_records(out) is None  # nothing left to keep
    assert (out / "previous" / "1" / "summary.json").read_text() == json.dumps(
        {"status": "completed", "steps_run": 2, "reward_last": 0.5}
    )


def test_a_resumed_runs_summary_covers_the_whole_run(tmp_path):
    records = [
        {"step": 0, "eval/arith/reward_mean": 0.25},
        {"step": 0, "rollout/reward_mean": 0.5, "perf/step_time": 2.0},
        {"step": 1, "rollout/reward_mean": 0.75, "perf/step_time": 4.0},
        {"step": 2, "rollout/reward_mean": 1.0, "perf/step_time": 6.0},  # the resumed invocation's step
        {"step": 3, "eval/arith/reward_mean": 0.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert completed_summary(tmp_path, 2) == {
        "output_dir": str(tmp_path),
        "status": "completed",
        "steps_run": 3,
        "resumed_at": [2],
        "reward_first": 0.5,
        "reward_last": 1.0,
        "reward_mean": 0.75,
        "mean_step_seconds": 4.0,
        "eval_first": {"eval/arith/reward_mean": 0.25},
        "eval_last": {"eval/arith/reward_mean": 0.5},
    }
    assert completed_summary(tmp_path, 0, resumed_at=[1])["resumed_at"] == [1]


def test_a_start_without_checkpoint_rolls_every_record_back(tmp_path):
    lines = [{"step": 0, "eval/a/reward_mean": 0.1}, {"step": 0, "x": 1.0}, {"step": 1, "x": 2.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    roll_back_records(tmp_path, 0)  # the evaluation before training runs again too
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    roll_back_records(tmp_path, 1)
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(json.dumps(r) + "\n" for r in lines[:2])


class _Trainer:
    def save_checkpoint(self, path: str) -> None:
        Path(path).mkdir(parents=True)
        (Path(path) / "optimizer.pt").write_bytes(b"state")


def test_by_default_only_the_checkpoint_a_resume_needs_is_kept(tmp_path):
    log = RunConfig.from_args(default_args()).logging
    assert log.keep_checkpoints == 1
    for step in (5, 10):
        save_checkpoint(log, tmp_path, step, step, _Trainer(), None, [])
    assert sorted(p.name for p in checkpoint_root(tmp_path).iterdir()) == ["latest", "step_000010"]
    keep_all = SimpleNamespace(keep_checkpoints=0)
    for step in (11, 12):
        save_checkpoint(keep_all, tmp_path, step, step, _Trainer(), None, [])
    assert sorted(p.name for p in checkpoint_root(tmp_path).iterdir()) == [
        "latest", "step_000010", "step_000011", "step_000012"
    ]  # fmt: skip
    commit_checkpoint(new_checkpoint_dir(tmp_path, 13), {"step": 13, "weight_version": 13}, None, 2)
    assert sorted(p.name for p in checkpoint_root(tmp_path).iterdir()) == ["latest", "step_000012", "step_000013"]


def test_keep_checkpoints_has_the_older_name_as_an_alias(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "p"}\n')
    base = ["--model", "m", "--prompt-data", str(prompts)]
    assert parse_run_args(base + ["--keep-checkpoints", "3"]).keep_checkpoints == 3
    assert parse_run_args(base + ["--max-checkpoints", "2"]).keep_checkpoints == 2
    config = tmp_path / "c.yaml"
    config.write_text("max_checkpoints: 4\n")
    assert parse_run_args(base + ["--config", str(config)]).keep_checkpoints == 4


def test_an_export_gets_the_permissions_of_the_other_outputs(tmp_path):
    old = os.umask(0o022)
    try:
        export = tmp_path / "final_hf"
        export.mkdir(mode=0o700)
        (export / "model.safetensors").write_bytes(b"w")
        (export / "model.safetensors").chmod(0o600)  # as transformers' save_pretrained leaves it
        (export / "config.json").write_text("{}")
        share_like_outputs(export)
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in [export, *export.iterdir()]}
        assert modes == {"final_hf": "0o755", "model.safetensors": "0o644", "config.json": "0o644"}
        os.umask(0o077)
        share_like_outputs(export)
        assert oct((export / "model.safetensors").stat().st_mode & 0o777) == "0o600"  # the user asked for that
    finally:
        os.umask(old)


def test_vime_eval_refuses_an_output_dir_holding_a_training_run(tmp_path):
    out = _finished(tmp_path / "run", 2)
    cfg = RunConfig.from_args(default_args(model="m", output_dir=out))
    with pytest.raises(ArgumentError) as e:
        preflight(cfg, "eval")
    assert str(e.value) == (
        f"--output-dir {out} holds a training run's records (checkpoints, summary.json): vime eval would write its "
        "own summary.json and metrics.jsonl there; give it another --output-dir (default: outputs/eval)"
    )
