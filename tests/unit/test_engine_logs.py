"""What the logs hold: the engine log no access line per request unless asked, and vLLM's "Failed to load weights"
warning only where it means something (:mod:`vime_core.engines.worker_extension`); the run's closing lines a short
summary, not the JSON record (:func:`vime_core.run.progress.summary_lines`); what Ray forwards from its workers no
tqdm bars or colour codes (:func:`vime_core.cluster.orchestration.quiet_worker_output`)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vime_core.engines.worker_extension import RELOAD_LOGGER, BenignReloadWarnings, quiet_benign_reload_warnings

pytestmark = pytest.mark.unit


def _warning(layer: str) -> logging.LogRecord:
    # exactly what vLLM's layerwise.py logs: logger.warning("%s: Failed to load weights", layer.__class__.__name__)
    return logging.LogRecord(
        RELOAD_LOGGER, logging.WARNING, "layerwise.py", 266, "%s: Failed to load weights", (layer,), None
    )


@pytest.mark.parametrize(
    ("tied", "layer", "kept"),
    [
        (True, "RotaryEmbedding", False),
        (False, "Llama3RotaryEmbedding", False),
        (True, "ParallelLMHead", False),
        (False, "ParallelLMHead", True),  # an untied head the update did not hold: a real problem
        (True, "QKVParallelLinear", True),
        (True, "VocabParallelEmbedding", True),
    ],
)
def test_only_layers_without_weights_of_their_own_are_quiet(tied, layer, kept):
    assert BenignReloadWarnings(tied).filter(_warning(layer)) is kept


def test_other_records_pass_and_the_filter_is_installed_once():
    f = BenignReloadWarnings(True)
    other = logging.LogRecord(RELOAD_LOGGER, logging.WARNING, "x.py", 1, "%s: Delayed processing", ("X",), None)
    assert f.filter(other) is True
    worker = SimpleNamespace(model_runner=SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace())))
    log = logging.getLogger(RELOAD_LOGGER)
    before = list(log.filters)
    try:
        quiet_benign_reload_warnings(worker)
        quiet_benign_reload_warnings(worker)
        added = [x for x in log.filters if x not in before]
        assert len(added) == 1 and added[0].tied_lm_head is False  # no tie_word_embeddings: not tied
    finally:
        log.filters[:] = before


def test_the_engine_access_log_is_off_unless_asked():
    from vime_core.cli.arguments import default_args

    assert default_args().rollout_engine_access_log is False
    assert default_args(rollout_engine_access_log=True).rollout_engine_access_log is True


def test_the_closing_summary_is_a_few_short_lines():
    from vime_core.run.progress import summary_lines

    run = {
        "output_dir": "/o",
        "steps_run": 5,
        "resumed_at": [3],
        "reward_first": 0.390625,
        "reward_last": 0.484375,
        "reward_mean": 0.4375,
        "mean_step_seconds": 26.04,
        "eval_first": {"eval/arith/reward_mean": 0.455, "eval/arith/pass@4": 0.6, "eval/gsm/reward_mean": 0.1},
        "eval_last": {"eval/arith/reward_mean": 0.566, "eval/arith/pass@4": 0.7, "eval/gsm/reward_mean": 0.25},
        "final_hf": "/o/final_hf",
        "ray_node_ip": "127.0.0.1",
    }
    assert summary_lines(run) == [
        "[vime] done: 5 step(s) (resumed at step 3), 26.0 s a step | reward 0.391 → 0.484 (mean 0.438)",
        "[vime] eval reward: arith 0.455 → 0.566 | gsm 0.100 → 0.250",
        "[vime] outputs: /o (summary.json, metrics.jsonl, final_hf/)",
    ]
    evaluation = {"model": "/m", "output_dir": "/e", "eval/arith/reward_mean": 0.5, "eval/arith/pass@4": 0.75}
    assert summary_lines(evaluation) == [
        "[vime] eval reward: arith 0.500",
        "[vime] outputs: /e (summary.json, metrics.jsonl)",
    ]


@pytest.mark.parametrize("tty", [False, True])
def test_ray_workers_write_no_progress_bars_and_no_colour_codes_into_a_log(monkeypatch, tty):
    from vime_core.cluster.orchestration import quiet_worker_output

    for key in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS", "RAY_COLOR_PREFIX"):
        monkeypatch.delenv(key, raising=False)
    assert quiet_worker_output(tty) == {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    import os

    assert os.environ.get("RAY_COLOR_PREFIX") == (None if tty else "0")
    monkeypatch.setenv("TQDM_DISABLE", "0")  # the user's choice is kept
    assert quiet_worker_output(tty)["TQDM_DISABLE"] == "0"
