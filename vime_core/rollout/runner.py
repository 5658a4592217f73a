"""Running groups: generate and score every sample of a list of groups concurrently.

:class:`GroupRunner` holds exactly what that needs — the generate and reward functions, the hooks, the teacher
(on-policy distillation), the engines' current weight version, the abort flag raised by
:func:`vime_core.rollout.oversample.collect_groups`, and the rollout progress counter. The rollout manager owns one
and hands it to the over-sampling loop (:mod:`vime_core.rollout.oversample`) and the fully-async producer
(:mod:`vime_core.rollout.async_producer`); this module imports neither of them nor the manager.

It also holds the per-sample primitives of a run: the engine sampling seed of a sample (:func:`sample_seed`) and
how a sample of a group returned by partial rollout resumes (:func:`needs_generation`, :func:`prepare_resume`).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from vime_core.config import RolloutConfig
from vime_core.config.context import CURRENT_ENGINES, PluginContext, ServedVersion, legacy_args
from vime_core.config.sampling import sampling_params
from vime_core.data.source import name_prompt_source
from vime_core.engines.health import EngineMonitor, generate_with_retries
from vime_core.failures import FailureCause, classify_failure, mark_failed
from vime_core.rewards.call import call_group_reward, call_reward
from vime_core.rollout.overlong import apply_overlong
from vime_core.types import Sample, Status

logger = logging.getLogger("vime.rollout")

FINISHED_STATUSES = frozenset({Status.COMPLETED, Status.TRUNCATED, Status.FAILED})


class Throttle:
    """True at most once per ``interval_s`` (the last call of a series is forced by the caller)."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.last = float("-inf")

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self.last >= self.interval_s:
            self.last = now
            return True
        return False


@dataclass
class _RunCall:
    """What the samples of one :meth:`GroupRunner.run` call share: the step, the bound on generate calls in flight,
    the sampling parameters, the reward functions, whether it trains, the segments of fanned-out samples
    (``id(sample) → segments``) and the failures seen (``(cause, error) → samples that failed so after the first``,
    logged once each)."""

    step: int
    sem: asyncio.Semaphore
    params: dict[str, Any]
    reward_fn: Any
    group_reward_fn: Any
    train: bool
    fanned: dict[int, list[Sample]] = field(default_factory=dict)
    repeats: dict[tuple[str, str], int] = field(default_factory=dict)


class GroupRunner:
    """Generates and scores groups of samples (see the module doc); a plain object with async methods driven by
    its owner's event loop (the rollout manager is a *sync* Ray actor, whose methods drive their own loop).

    :param ctx: the run's configuration, passed to the generate and reward functions; the runner reads
        ``ctx.rollout`` (``config``: ``--rollout-concurrency``, sampling parameters, ``--seed``, ``--reward-timeout``,
        ``--mask-offpolicy-in-partial-rollout``, DAPO's overlong flags).
    :param generate_fn: the ``--generate`` function ``async (ctx, sample, sampling_params) -> Sample | list``.
    :param reward_fn: the ``--reward`` function.
    :param hook: the plugin manager's hook relay (``vime_on_sample`` is called for every training sample).
    :param group_reward_fn: the ``--group-reward`` function, or ``None``.
    :param progress: a :class:`vime_core.run.progress.RolloutProgress` actor told how many samples finished, or
    ``None``.
    :ivar monitor: the engine health monitor; a sample whose engine or router failed under it is regenerated
        (:func:`vime_core.engines.health.generate_with_retries`); ``None``: one attempt.
    :ivar teacher: the :class:`~vime_core.engines.teacher.TeacherEngines` scoring training samples, or ``None``.
    :ivar weight_version: the weight version the engines serve (a resumed sample's off-policy prefix is older):
        ``ctx.engines``' holder, or one of the runner's own for a context without engines.
    :ivar aborting: set while the requests in flight are being aborted; a sample still waiting is not sent.
    :ivar samples_done: samples of the current step finished; ``samples_wanted``: of how many (0: fully-async).
    """

    def __init__(
        self,
        ctx: PluginContext,
        generate_fn: Any,
        reward_fn: Any,
        hook: Any,
        group_reward_fn: Any = None,
        progress: Any = None,
    ) -> None:
        self.ctx = ctx  # passed to the plugin functions
        self.config = ctx.rollout
        self.generate_fn = generate_fn
        self.reward_fn = reward_fn
        self.group_reward_fn = group_reward_fn
        self.hook = hook
        self.teacher: Any = None
        self.monitor: EngineMonitor | None = None
        self.served = ctx.engines.served if ctx.engines is not None else ServedVersion()
        self.aborting = False
        self.progress = progress
        self.progress_throttle = Throttle()
        self.samples_done, self.samples_wanted = 0, 0

    @property
    def weight_version(self) -> int:
        """The weight version the engines serve now (the one holder, :attr:`served`)."""
        return self.served.value

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.served.value = version

    def report_progress(self, done: int, wanted: int | None = None, force: bool = True) -> None:
        """Tell the progress actor ``done`` of ``wanted`` samples finished (throttled unless ``force``)."""
        self.samples_done = done
        if wanted is not None:
            self.samples_wanted = wanted
        if self.progress is not None and (force or self.progress_throttle()):
            self.progress.set.remote(self.samples_done, self.samples_wanted)

    async def run(
        self,
        groups: list[list[Sample]],
        step: int,
        sem: asyncio.Semaphore | None = None,
        *,
        params: dict[str, Any] | None = None,
        reward_fn: Any = None,
        train: bool = True,
    ) -> None:
        """Generate and score every sample of ``groups`` concurrently. ``sem`` bounds the generate calls in flight
        when several calls share it (default: ``--rollout-concurrency`` for this call).

        Each sample is scored by ``--reward`` as soon as it is generated; with ``--group-reward`` a group is scored
        at once when all its samples have finished. Whatever fails marks the sample ``failed`` with its cause
        (:func:`vime_core.failures.classify_failure`; reward errors, timeouts and non-finite values included).
        A fan-out generate function's segments replace their sample in its group list, in place.

        ``params`` / ``reward_fn`` default to the training rollout's sampling parameters and ``--reward``; with
        ``train=False`` (evaluation) the sample reward ``reward_fn`` is used even with ``--group-reward``, the
        teacher does not score, the rollout progress is not advanced and ``vime_on_sample`` is not called."""
        ctx, cfg = self.ctx, self.config
        if ctx.engines is not None:  # for plugins still calling the deprecated get_rollout_context() (until 0.2)
            CURRENT_ENGINES.set(ctx.engines)
        call = _RunCall(
            step,
            sem or asyncio.Semaphore(cfg.rollout_concurrency),
            sampling_params(cfg) if params is None else params,
            reward_fn or self.reward_fn,
            self.group_reward_fn if train else None,
            train,
        )

        async def group(g: list[Sample]) -> None:
            results = await asyncio.gather(*(self._one(s, call) for s in g))
            ran = [outs for outs in results if outs is not None]
            if call.group_reward_fn is not None:
                rollouts = [outs or [s] for s, outs in zip(g, results, strict=True)]
                await self._score_group(call.group_reward_fn, g, rollouts)
            for outs in ran if train else ():
                for s in outs:
                    self.hook.vime_on_sample(ctx=ctx, sample=s, step=step, args=legacy_args(ctx.config))

        await asyncio.gather(*(group(g) for g in groups))
        for (cause, error), n in call.repeats.items():
            if n:
                logger.warning("%d more sample(s) failed (%s) with the same error: %s", n, cause, error[:500])
        for g in groups:  # replace fanned-out samples by their segments, in place (callers hold these lists)
            if any(id(s) in call.fanned for s in g):
                g[:] = [x for s in g for x in call.fanned.get(id(s), [s])]

    async def _one(self, sample: Sample, call: _RunCall) -> list[Sample] | None:
        """Generate (and, without a group reward, score) one sample of a :meth:`run` call; its output samples, or
        None if skipped."""
        if not needs_generation(sample):  # finished in an earlier step (a group returned by partial rollout)
            return None
        cfg = self.config
        sample_params = dict(call.params)
        if cfg.seed is not None:  # reproducible sampling: one engine seed per sample, distinct within the group
            sample_params["seed"] = sample_seed(cfg.seed, call.step, sample.group_index, sample.index)
        async with call.sem:
            if self.aborting:  # the batch filled while this sample waited: never sent
                sample.status = Status.ABORTED
                return None
            if sample.status == Status.ABORTED:  # partial rollout: continue from prompt + partial response
                prepare_resume(sample, self.weight_version, cfg.mask_offpolicy_in_partial_rollout)
            outs = await self._attempt(sample, sample_params, call)
        if call.train:
            self.report_progress(self.samples_done + 1, force=False)
        return outs

    async def _attempt(self, sample: Sample, sample_params: dict[str, Any], call: _RunCall) -> list[Sample]:
        """Generate ``sample`` (regenerated after an engine failure), score it without a group reward and have the
        teacher score it in training; whatever fails marks it ``failed`` with its cause. Its output samples."""
        ctx, cfg = self.ctx, self.config
        outs = [sample]
        stage = "generate"
        try:
            out = await generate_with_retries(self.monitor, self.generate_fn, ctx, sample, sample_params)
            if isinstance(out, list):  # fan-out: segments of one rollout, scored once, same reward on each
                if not out:
                    raise ValueError("the generate function returned an empty list of samples")
                rid = next((s.episode_id for s in out if s.episode_id), None) or uuid.uuid4().hex
                for s in out:
                    s.episode_id = rid
                outs = list(out)
            elif out is not sample:
                sample.__dict__.update(out.__dict__)
            for s in outs:
                s.validate()
            scored = [s for s in outs if s.status in (Status.COMPLETED, Status.TRUNCATED)]
            if scored and call.group_reward_fn is None:
                stage = "reward"
                reward = await call_reward(call.reward_fn, ctx, scored[0], cfg.reward_timeout)
                _set_reward(cfg, outs, reward, overlong=call.train)
                stage = "teacher"
                if call.train and self.teacher is not None:  # on-policy distillation: the teacher scores the tokens
                    await self.teacher.score(scored)
            if outs[0] is not sample:
                call.fanned[id(sample)] = outs
        except Exception as e:  # noqa: BLE001 - recorded on the sample, excluded, counted in metrics
            cause = classify_failure(e, stage)
            key = (cause.value, f"{type(e).__name__}: {e}")
            if key in call.repeats:  # the same error again: counted, one line for all of them after the call
                call.repeats[key] += 1
            else:
                call.repeats[key] = 0
                logger.warning("sample %d/%d failed (%s): %s", sample.group_index, sample.index, *key)
            call.fanned.pop(id(sample), None)
            outs = [mark_failed(sample, cause, e)]
            if cause == FailureCause.REWARD_ERROR:  # a reward that raises: often a row it cannot handle
                name_prompt_source(sample)
        return outs

    async def _score_group(self, fn: Any, group: list[Sample], rollouts: list[list[Sample]]) -> None:
        """``--group-reward``: once no sample of ``group`` is left to generate (none aborted or pending), score the
        rollouts that finished, one representative sample each (``rollouts[i][0]``), and give each rollout its
        score; a failure fails the rollouts it concerns, with its cause."""
        if any(s.status in (Status.ABORTED, Status.PENDING) for s in group):
            return  # partial rollout: the group returns to the buffer and is scored when it completes
        todo = [outs for outs in rollouts if outs[0].status in (Status.COMPLETED, Status.TRUNCATED)]
        if not todo:
            return
        timeout = self.config.reward_timeout
        try:
            rewards: list[Any] = await call_group_reward(fn, self.ctx, [outs[0] for outs in todo], timeout)
        except Exception as e:  # noqa: BLE001 - every rollout of the group fails with the cause
            rewards = [e] * len(todo)
        for outs, reward in zip(todo, rewards, strict=True):
            if isinstance(reward, Exception):
                cause = classify_failure(reward, "reward")
                logger.warning(
                    "group %d: sample %d failed (%s): %s", outs[0].group_index, outs[0].index, cause.value, reward
                )
                for s in outs:
                    mark_failed(s, cause, reward)
                    if cause == FailureCause.REWARD_ERROR:
                        name_prompt_source(s)
            else:
                _set_reward(self.config, outs, reward)
        if self.teacher is not None:
            scored = [s for outs in todo for s in outs if s.status in (Status.COMPLETED, Status.TRUNCATED)]
            try:
                await self.teacher.score(scored)
            except Exception as e:  # noqa: BLE001
                cause = classify_failure(e, "teacher")
                for s in scored:
                    mark_failed(s, cause, e)


def _set_reward(
    cfg: RolloutConfig, outs: list[Sample], reward: float | dict[str, float], overlong: bool = True
) -> None:
    """Give every scorable sample of one rollout (``outs``: the sample, or its fan-out segments) the reward, and the
    first one's metadata keys the others lack; then DAPO's overlong filter / soft punishment when enabled
    (:func:`vime_core.rollout.overlong.apply_overlong`; not for evaluation, ``overlong=False``)."""
    scored = [s for s in outs if s.status in (Status.COMPLETED, Status.TRUNCATED)]
    for s in scored:
        s.reward = copy.deepcopy(reward)
        s.metadata.update({k: v for k, v in scored[0].metadata.items() if k not in s.metadata})
        if overlong:
            apply_overlong(cfg, s)


def sample_seed(seed: int, step: int, group_index: int, sample_index: int) -> int:
    """The engine sampling seed of one sample (vLLM's per-request ``seed``), so that a run's sampling is reproducible
    from ``--seed`` while the samples of a group (same prompt, different ``sample_index``) differ.

    The first 8 bytes of BLAKE2b over ``"vime-rollout-seed:{seed}:{step}:{group_index}:{sample_index}"`` as a
    little-endian integer, top bit cleared (a non-negative int64, what vLLM and ``torch.Generator`` accept).

    :param seed: ``--seed``.
    :param step: the rollout step generating the sample (``-1`` in ``--loop fully-async``'s producer); a sample
        resumed by partial rollout in a later step gets a new seed.
    :param group_index: the group's run-wide index (:class:`~vime_core.data.source.DataSource` numbers groups).
    :param sample_index: the sample's index in its group.
    :return: an int in ``[0, 2**63)``.
    """
    key = f"vime-rollout-seed:{seed}:{step}:{group_index}:{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


def prepare_resume(sample: Sample, current_version: int, mask_offpolicy: bool) -> int:
    """Make an aborted sample ready to continue generating (status ``pending``, response kept).

    Records ``metadata["partial_rollout"] = {"resumes": k, "resumed_at_tokens": [...], "masked_tokens": m}``
    (``resumed_at_tokens``: the response length at each resume) when the sample has a partial response.

    :param sample: an ``aborted`` sample whose ``tokens`` = prompt + partial response.
    :param current_version: the weight version the engines serve now (the continuation's version).
    :param mask_offpolicy: set ``loss_mask`` to 0 on the response tokens whose weight version is older than
        ``current_version`` (``--mask-offpolicy-in-partial-rollout``).
    :return: how many tokens were newly masked.
    """
    masked = 0
    if mask_offpolicy:
        for i, (m, v) in enumerate(zip(sample.loss_mask, sample.weight_versions, strict=True)):
            if m and v < current_version:
                sample.loss_mask[i] = 0
                masked += 1
    if sample.response_length:
        meta = sample.metadata.setdefault(
            "partial_rollout", {"resumes": 0, "resumed_at_tokens": [], "masked_tokens": 0}
        )
        meta["resumes"] += 1
        meta["resumed_at_tokens"].append(sample.response_length)
        meta["masked_tokens"] += masked
    sample.status = Status.PENDING
    return masked


def needs_generation(sample: Sample) -> bool:
    """False for a sample of a returned group that already finished (completed, truncated or failed)."""
    return sample.status not in FINISHED_STATUSES
