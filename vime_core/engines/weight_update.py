"""The one weight-update sequence of the rollout's engines: pause → apply → reset prefix cache → label → resume.

:func:`update_engines` runs it over engine slots (anything with ``index``, ``engine`` and ``state``); the engine fleet
calls it for every update (:meth:`vime_core.engines.fleet.EngineFleet.update_weights`), through the health monitor
when there is one (:meth:`vime_core.engines.health.EngineMonitor.sync_weights` holds the monitor's lock, picks the
engines that are up and guards each call: an engine found dead or hung is taken down instead of failing the update).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vime_core.weight_sync.base import WeightSyncStrategy, WeightUpdate, call_with_timeout

#: ``guard(slot, fn)`` runs ``fn`` for ``slot``'s engine: ``True`` when it ran, ``False`` when the engine was found
#: dead (and taken down) instead; any other failure raises
Guard = Callable[[Any, Callable[[], Any]], bool]


def unguarded(slot: Any, fn: Callable[[], Any]) -> bool:
    """The :data:`Guard` without a health monitor: run ``fn``; whatever it raises fails the update."""
    fn()
    return True


def update_engines(
    slots: list[Any],
    weight_sync: WeightSyncStrategy,
    update: WeightUpdate,
    mode: str,
    timeout_s: float,
    guard: Guard = unguarded,
) -> dict[str, float]:
    """Pause the engines of ``slots``, apply ``update`` (the strategy's ``apply_all`` in one collective when it
    overrides it, else ``apply`` engine by engine), reset each engine's prefix cache, label its version, resume.

    Every engine call goes through ``guard`` and is bounded by ``timeout_s``; a slot whose state leaves ``"up"``
    meanwhile is skipped from then on.

    :param mode: the pause mode (``"wait"``, or ``"keep"`` in fully-async).
    :return: ``weight_sync/engines_synced`` and the seconds of each phase over all engines:
        ``weight_sync/pause_seconds``, ``weight_sync/load_seconds`` (the strategy's transfer and load),
        ``weight_sync/label_seconds`` (prefix-cache reset and version label), ``weight_sync/resume_seconds``.
    :raises TimeoutError: an engine call that did not finish within ``timeout_s``.
    :raises RuntimeError: from an engine or the strategy (what ``guard`` does not absorb).
    """
    own_apply_all = type(weight_sync).apply_all is not WeightSyncStrategy.apply_all
    phase = dict.fromkeys(("pause", "load", "label", "resume"), 0.0)

    def timed(name: str, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        try:
            fn()
        finally:
            phase[name] += time.perf_counter() - t0

    def bounded(slot: Any, what: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        # every engine call of the update is bounded by the timeout, not only the strategy's transfer
        return lambda: call_with_timeout(fn, timeout_s, f"{what} of engine {slot.index} ({slot.engine.url})")

    paused = [
        s for s in slots if guard(s, lambda s=s: timed("pause", bounded(s, "pause", lambda: s.engine.pause(mode))))
    ]
    try:
        if own_apply_all:  # one collective over every engine (nccl): no engine can be left out
            timed("load", lambda: weight_sync.apply_all([s.engine for s in paused], update, timeout_s))
        for s in paused:
            if s.state != "up":
                continue

            def step(s: Any = s) -> None:
                if not own_apply_all:
                    timed("load", lambda: weight_sync.apply(s.engine, update, timeout_s))
                timed("label", bounded(s, "prefix-cache reset", s.engine.reset_prefix_cache))
                label = bounded(s, "version label", lambda: s.engine.set_weight_version(update.version))
                timed("label", label)

            guard(s, step)
    finally:
        for s in paused:
            if s.state == "up":
                guard(s, lambda s=s: timed("resume", bounded(s, "resume", s.engine.resume)))
    metrics = {"weight_sync/engines_synced": float(sum(s.state == "up" for s in paused))}
    metrics.update({f"weight_sync/{k}_seconds": v for k, v in phase.items()})
    return metrics
