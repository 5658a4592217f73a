"""One training step under ``torch.profiler``, on request: ``VIME_PROFILE_TRAIN_STEP=N`` profiles the train step of
rollout step N (0-based, :attr:`RolloutBatch.step <vime_core.types.RolloutBatch.step>`) on each trainer rank and
writes the operators that took the most time (the GPU's, with CUDA; else the CPU's) to
``OUTPUT_DIR/logs/profile_train_step_<N>_rank<R>.txt`` (``$VIME_PROFILE_DIR`` instead of ``OUTPUT_DIR/logs``), and
the chrome trace beside it with ``VIME_PROFILE_TRACE=1``. ``bench/gpu_loop.py --profile`` sets them and prints the
table.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("vime.trainer")

PROFILE_ENV = "VIME_PROFILE_TRAIN_STEP"
PROFILE_DIR_ENV = "VIME_PROFILE_DIR"
PROFILE_TRACE_ENV = "VIME_PROFILE_TRACE"
#: rows of the written table
TOP_ROWS = 40


def profile_path(step: int, backend: Any, env: dict[str, str] | None = None) -> Path | None:
    """Where the table of rollout step ``step``'s train step goes, or ``None`` when it is not to be profiled.

    :raises ValueError: ``$VIME_PROFILE_TRAIN_STEP`` is not an integer (naming it).
    """
    env = os.environ if env is None else env
    wanted = env.get(PROFILE_ENV)
    if wanted is None or wanted == "":
        return None
    try:
        wanted_step = int(wanted)
    except ValueError:
        raise ValueError(f"${PROFILE_ENV}={wanted!r}: expected the 0-based index of a rollout step") from None
    if wanted_step != step:
        return None
    root = env.get(PROFILE_DIR_ENV) or Path(backend.run_config.logging.output_dir) / "logs"
    rank = getattr(backend, "rank", 0)
    return Path(root) / f"profile_train_step_{step}_rank{rank}.txt"


@contextmanager
def profiled(step: int, backend: Any) -> Iterator[None]:
    """Run the body under ``torch.profiler`` when ``step`` is the requested one (:func:`profile_path`), then write
    the top :data:`TOP_ROWS` operators by self time (``key_averages().table``)."""
    path = profile_path(step, backend)
    if path is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=TOP_ROWS)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"train step of rollout step {step}, sorted by {sort}\n{table}\n")
    if os.environ.get(PROFILE_TRACE_ENV) == "1":
        prof.export_chrome_trace(str(path.with_suffix(".trace.json")))
    logger.info("profiled the train step of rollout step %d: %s", step, path)


def cuda_malloc_count() -> int | None:
    """How many segments this process's CUDA caching allocator has taken from the driver so far (``cudaMalloc``
    calls: ``torch.cuda.memory_stats()["segment.all.allocated"]``, cumulative), or ``None`` without CUDA. Each one
    costs the launching thread far more than a cached block: after ``empty_cache()`` a step pays them again."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.memory_stats().get("segment.all.allocated", 0))
