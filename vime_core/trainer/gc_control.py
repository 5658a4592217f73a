"""Python's garbage collector in a trainer rank: the seconds its collections take during a train step
(:class:`GcClock`), the start-up heap frozen out of later collections (:func:`freeze_heap`, as vLLM's engine does
after start-up) and Megatron-LM's manual mode (``--manual-gc``, ``--manual-gc-interval``: :class:`ManualGc`).

A trainer rank imports torch, megatron-core, Ray and often vLLM: ~0.5 M tracked objects, so one full (generation 2)
collection walks them all (0.1-0.2 s) in the middle of whatever train step triggered it. docs/gpu.md has the figures.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcClock:
    """Seconds and number of this process's garbage collections between :meth:`start` and :meth:`stop`, read from
    ``gc.callbacks`` (every generation, automatic and explicit ``gc.collect()`` alike).

    :ivar seconds: wall seconds spent inside collections (float).
    :ivar collections: collections finished (int).
    :ivar full: of them, generation-2 (full) collections (int).
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self.full = 0
        self._began: float | None = None

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self.collections += 1
            self.full += info["generation"] == 2
            self._began = None

    def start(self) -> GcClock:
        """Reset the counts and start listening; returns ``self``."""
        self.seconds, self.collections, self.full, self._began = 0.0, 0, 0, None
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def stop(self) -> dict[str, float]:
        """Stop listening; the step's metrics: ``perf/train_gc_time`` (seconds), ``perf/train_gc_collections`` and
        ``perf/train_gc_full_collections`` (counts, as floats)."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        return {
            "perf/train_gc_time": self.seconds,
            "perf/train_gc_collections": float(self.collections),
            "perf/train_gc_full_collections": float(self.full),
        }


def freeze_heap() -> int:
    """Collect once, then move every object tracked so far to the permanent generation (``gc.freeze()``), so that
    later collections walk only what the run creates after start-up (the modules, the model's Python objects and
    the optimizer stay out of them). vLLM does the same after its engine starts (``freeze_gc_heap``).

    :returns: the number of objects frozen.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class ManualGc:
    """Megatron-LM's ``--manual-gc``: automatic (threshold-based) collection off in this process, and a full
    ``gc.collect()`` after every ``interval``-th train step (``--manual-gc-interval``; 0: never between steps), so
    collections happen at a known point of the step instead of inside the forward or backward.

    :param interval: train steps between collections (>= 0).
    :raises ValueError: ``interval`` < 0, naming ``--manual-gc-interval``.
    """

    def __init__(self, interval: int) -> None:
        if interval < 0:
            raise ValueError(f"--manual-gc-interval must be >= 0 (train steps between collections), got {interval}")
        self.interval = interval
        self.steps = 0
        gc.disable()

    def after_step(self) -> bool:
        """Count a train step; collect (all generations) when it is an ``interval``-th one. Returns whether it did."""
        self.steps += 1
        if self.interval and self.steps % self.interval == 0:
            gc.collect()
            return True
        return False
