"""The metrics sink: metrics.jsonl, the staleness histogram metric, and a real W&B run in offline mode (no network)
whose run file is read back record by record (:mod:`vime_core.testing.wandb_offline`)."""

import json
from pathlib import Path

import pytest

from vime_core.cli.arguments import default_args
from vime_core.config import LoggingConfig
from vime_core.run.metrics import MetricsSink, WandbConfig, staleness_histogram, wandb_config

pytestmark = pytest.mark.unit


def test_staleness_histogram_counts_tokens_per_version_lag():
    assert staleness_histogram(5, [5, 5, 4, 3, 4, 4]) == {
        "rollout/staleness_tokens/0": 2.0,
        "rollout/staleness_tokens/1": 3.0,
        "rollout/staleness_tokens/2": 1.0,
    }
    assert staleness_histogram(0, []) == {}


def test_wandb_config():
    args = default_args(
        use_wandb=True,
        wandb_project="p",
        wandb_mode="offline",
        wandb_dir=None,
        wandb_group="g",
        wandb_run_name=None,
        wandb_team=None,
        wandb_run_id=None,
        output_dir=Path("/x/outputs/quick"),
        lr=2e-6,
    )
    cfg = wandb_config(LoggingConfig.from_args(args), vars(args))
    assert (cfg.project, cfg.mode, cfg.directory, cfg.group, cfg.name) == (
        "p",
        "offline",
        Path("/x/outputs/quick"),
        "g",
        "quick",
    )
    assert cfg.config["lr"] == 2e-6 and cfg.config["output_dir"] == "/x/outputs/quick"
    args.use_wandb = False
    assert wandb_config(LoggingConfig.from_args(args), vars(args)) is None


def test_wandb_offline_run_holds_every_step(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra (pip install 'vime[wandb]') is not installed")
    for var in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_env_dir"))  # --wandb-dir wins over it
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    steps = [
        (0, {"rollout/reward_mean": 0.25, "perf/rollout_time": 12.5, "rollout/staleness_tokens/0": 256.0}),
        (0, {"eval/arith/reward_mean": 0.125, "eval/arith/pass@4": 0.5}),  # a second line for the same step
        (1, {"rollout/reward_mean": 0.5, "train/grad_norm": 1.75, "weight_sync/bytes": 538049536.0}),
        (2, {"rollout/reward_mean": 0.75, "train/grad_norm": 0.5}),
    ]
    config = {"lr": 2e-06, "loop": "sync", "output_dir": str(tmp_path)}
    sink = MetricsSink(
        tmp_path,
        use_tensorboard=False,
        wandb=WandbConfig(project="vime-test", mode="offline", directory=tmp_path, group="g1", name="r1",
                          config=config),
    )  # fmt: skip
    for step, m in steps:
        sink.log(step, m)
    sink.close()

    from vime_core.testing.wandb_offline import history, offline_run_file, run_info, wait_finished

    run_file = offline_run_file(tmp_path)
    wait_finished(run_file)
    assert history(run_file) == [{**m, "step": step} for step, m in steps]
    # the same lines in metrics.jsonl
    jsonl = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert jsonl == [{"step": step, **m} for step, m in steps]
    run, got_config = run_info(run_file)
    assert (run.project, run.run_group, run.display_name) == ("vime-test", "g1", "r1")
    assert got_config == config
    assert not (tmp_path / "wandb_env_dir").exists()
