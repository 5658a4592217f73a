"""What a step that trained and then failed saves: every engine lost (:func:`stop_engines_lost`) or its weights not
writable for the engines (:func:`save_after_failed_write`); each checkpoints what trained so a resume loses nothing."""

from __future__ import annotations

import logging

from vime_core.engines.health import EnginesLostError
from vime_core.run.checkpoint_schedule import TRAINED_PROMPTS_FILE, append_jsonl, save_checkpoint
from vime_core.run.state import RunState
from vime_core.weight_sync.base import WeightWriteError

logger = logging.getLogger("vime.loop")


def stop_engines_lost(run: RunState, error: BaseException, trained_version: int | None = None) -> EnginesLostError:
    """Every engine is lost during step ``run.step`` (at weight version ``run.version``): checkpoint what trained so
    the run can resume.

    * The rollout failed (``trained_version`` None): ``step`` steps finished; the groups the failed step took are
      back in the rollout manager's buffer (:meth:`~vime_core.rollout.manager.RolloutManager.generate`; with
      ``fully-async`` re-queued by the producer), so the checkpoint's data state holds them and a resume trains
      them — each prompt once.
    * The step trained but its weight update found no engine (``trained_version``: the weights it pushed): the
      step counts as finished (``step + 1`` steps, weight version ``trained_version``; a resume pushes the weights
      in full) and its prompts are recorded in ``trained_prompts.jsonl``.

    Either way, with ``one-step-off`` the next step's groups, if they were generated, are saved as unconsumed.

    :return: the error to raise: the monitor's report (without Ray's traceback) and what was saved.
    """
    step, version, out, source = run.step, run.version, run.out, run.source
    done = step
    if trained_version is not None:
        append_jsonl(out / TRAINED_PROMPTS_FILE, {"step": step, **source.last_taken})
        done, version = step + 1, trained_version
    saved = None
    if run.trainer is not None:
        saved = save_checkpoint(run.log, out, done, version, run.trainer, run.rollout, source.unconsumed())
    where = f"checkpoint of {done} finished step(s) saved: {saved}" if saved else "no trainer to save"
    return EnginesLostError(f"{getattr(error, 'cause', None) or error}\n{where}")


def save_after_failed_write(run: RunState, error: BaseException) -> WeightWriteError:
    """Step ``run.step`` trained but its weights could not be written for the engines (full or read-only
    ``--update-weight-disk-dir``; the engines keep version ``run.version``): checkpoint the trained step (weight
    version ``run.version + 1``; a resume pushes it to the engines in full) so nothing trained is lost, when the
    checkpoint directory can be written.

    :return: the error to raise: the write error's message (without Ray's traceback) and what was saved.
    """
    step, version, out, source = run.step, run.version, run.out, run.source
    message = str(getattr(error, "cause", None) or error)
    append_jsonl(out / TRAINED_PROMPTS_FILE, {"step": step, **source.last_taken})
    try:
        saved = save_checkpoint(run.log, out, step + 1, version + 1, run.trainer, run.rollout, source.unconsumed())
    except Exception as e:  # noqa: BLE001 - the write error is the one to report
        logger.exception("checkpoint after the failed weight write")
        return WeightWriteError(f"step {step + 1}: {message}; its training could not be checkpointed either ({e})")
    return WeightWriteError(f"step {step + 1}: {message}; the trained step is saved in {saved} (a re-run resumes it)")
