"""One RL train step, shared by every trainer backend: the algorithm lives here once, a backend supplies forward
passes and optimizer steps.

:func:`rl_train_step` runs slime's ``train_actor`` order on any :class:`PolicyOps` (with a :class:`ReferenceOps`
and a :class:`~vime_core.trainer.critic.CriticBase`); :func:`dp_shard` splits each mini-batch over data-parallel
ranks. The order of a step: docs/algorithms.md, "One RL step, both backends"; data parallelism: docs/cluster.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vime_core.algorithms.batch import gae_advantages, postprocess_advantages
from vime_core.algorithms.kl import approx_kl
from vime_core.algorithms.mismatch import check_logprob_drift
from vime_core.algorithms.policy_loss import PolicyLossOptions, correction_settings, policy_loss
from vime_core.algorithms.rollout_correction import mismatch_metrics, pad_batch, rollout_correction
from vime_core.config import AlgorithmConfig, TrainerConfig
from vime_core.trainer.critic import CriticBase
from vime_core.trainer.lr_schedule import policy_lr_schedule, set_lr
from vime_core.trainer.profile import profiled
from vime_core.types import RolloutBatch, Sample


class ReferenceOps(Protocol):
    """The frozen reference policy (KL)."""

    def log_probs(self, samples: list[Sample], micro_batch_size: int) -> dict[int, torch.Tensor]:
        """``id(sample) → [response_length]`` float32 CPU log-probs (no grad)."""


class PolicyOps(Protocol):
    """What a backend supplies to :func:`rl_train_step`."""

    trainer_config: TrainerConfig
    algorithm_config: AlgorithmConfig
    steps_done: int
    optimizer: Any  # a torch or Megatron optimizer; its param groups' "lr" is set before every step
    ref_model: ReferenceOps | None
    critic: CriticBase | None
    loss_device: torch.device
    dp_rank: int  # this rank's data-parallel rank (0 … dp_size - 1; the same on the TP ranks of one DP rank)
    dp_size: int  # data-parallel ranks; the backend's gradient reduction averages over them (1: none)

    def policy_log_probs(
        self, samples: list[Sample], with_entropy: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """One micro-batch forward: per sample ``[response_length]`` float32 log-probs (and next-token entropies,
        nats) of the response tokens, graph attached, on ``loss_device``. The entropies need a graph only with
        ``--entropy-coef`` != 0 (else the loss uses them as a metric only, detached)."""

    def zero_grad(self) -> None:
        """Clear the policy's gradients before a mini-batch."""

    def optimizer_step(self) -> float:
        """Clip and apply the accumulated gradients; return the gradient norm before clipping.

        :raises FloatingPointError: on a non-finite gradient norm (no update is made).
        """

    def dp_all_gather(self, obj: Any) -> list[Any]:
        """Every DP rank's ``obj`` (picklable), in DP-rank order (a collective of the DP group)."""


class StepTimer:
    """Wall seconds of a train step's phases (``perf/train_<phase>_time``): each :meth:`lap` charges the time since
    the previous one to a phase, after waiting for the GPU's queued work (``torch.cuda.synchronize``), so a phase is
    charged what it ran, not what it launched. The forward pass already waits for its log-probs (they go to the
    CPU), so the waits cost little."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.seconds: dict[str, float] = {}
        self._last = self._now()

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the last lap (or the start) to ``phase``."""
        now = self._now()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

    def metrics(self) -> dict[str, float]:
        """``perf/train_<phase>_time`` for every phase charged."""
        return {f"perf/train_{k}_time": v for k, v in self.seconds.items()}


def dp_shard(items: list[Any], dp_rank: int, dp_size: int) -> list[Any]:
    """DP rank ``dp_rank``'s share of ``items``: ``items[dp_rank], items[dp_rank + dp_size], ...`` (slime's strided
    split of a rollout batch; of a mini-batch of ``global_batch`` samples each rank gets ``global_batch / dp_size``,
    one more on the first ``global_batch % dp_size`` ranks).

    :raises ValueError: unless ``0 <= dp_rank < dp_size``.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"data-parallel rank {dp_rank} is not in 0 … {dp_size - 1}")
    return items[dp_rank::dp_size]


def share_across_dp(backend: PolicyOps, samples: list[Sample], of: dict[int, torch.Tensor]) -> None:
    """Fill ``of`` (``id(sample) → tensor``, this rank's entries) with every DP rank's entries for ``samples``
    (keyed by position in ``samples``, the same list on every rank). Nothing to do on one DP rank."""
    if backend.dp_size == 1:
        return
    mine = {i: of[id(s)] for i, s in enumerate(samples) if id(s) in of}
    for part in backend.dp_all_gather(mine):
        for i, t in part.items():
            of.setdefault(id(samples[i]), t)


def dp_log_probs(backend: PolicyOps, samples: list[Sample], compute: Any) -> dict[int, torch.Tensor]:
    """``compute(shard) → {id(sample): tensor}`` on this DP rank's shard of ``samples``, all-gathered: every rank
    returns the entries of all ``samples`` (a no-grad forward pass split over the DP ranks)."""
    out = compute(dp_shard(samples, backend.dp_rank, backend.dp_size))
    share_across_dp(backend, samples, out)
    return out


def micro_batches(samples: list[Sample], micro_batch_size: int) -> Iterator[list[Sample]]:
    """Micro-batches of ``micro_batch_size`` samples in order of length (less padding)."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].tokens))
    for i in range(0, len(order), micro_batch_size):
        yield [samples[j] for j in order[i : i + micro_batch_size]]


@torch.no_grad()
def old_log_probs(backend: PolicyOps, samples: list[Sample]) -> dict[int, torch.Tensor]:
    """Current-policy log-probs of every sample before any update, ``id(sample) → [T]`` float32 on CPU."""
    out: dict[int, torch.Tensor] = {}
    for mb in micro_batches(samples, backend.trainer_config.micro_batch_size):
        for s, lp in zip(mb, backend.policy_log_probs(mb, False)[0], strict=True):
            out[id(s)] = lp.float().cpu()
    return out


def rl_train_step(backend: PolicyOps, batch: RolloutBatch) -> dict[str, float]:
    """One RL step on ``batch``: ``ceil(len / global_batch_size)`` optimizer steps (see the module docstring).

    :param backend: the trainer (its ``steps_done`` is advanced by one per optimizer step).
    :param batch: samples (``tokens``, ``loss_mask``, ``rollout_log_probs``) and the estimator's per-sample,
        per-token advantages (per-token rewards for ``ppo``).
    :return: metrics ``train/loss``, ``train/pg_loss``, ``train/pg_clipfrac``, ``train/ppo_kl``,
        ``train/entropy_loss``, ``train/grad_norm``, ``train/train_rollout_logprob_abs_diff`` (exact token mean over
        the batch, before the update), ``train/lr``, ``train/num_tokens`` (response tokens),
        ``train/num_seq_tokens`` (prompt and response tokens the passes ran on), ``train/adv/*``, and when enabled
        ``train/kl_loss``, ``train/tis``, ``train/tis_clipfrac`` and the other rollout-correction metrics,
        ``train/pg_dual_clipfrac``, ``train/mismatch/*`` (``--get-mismatch-metrics``: exact over the batch, before
        the update); with ``ppo``
        ``train/value_loss``, ``train/value_clipfrac``, ``train/critic_grad_norm``, ``train/critic_lr``,
        ``train/critic/values_mean``, ``train/critic/returns_mean``, ``train/critic_only``;
        ``perf/train_compute_time`` (seconds) and its split (:class:`StepTimer`): ``perf/train_forward_time``
        (policy forward passes and the loss), ``perf/train_backward_time``, ``perf/train_optimizer_time`` (gradient
        finalisation, norm, clipping and the update), ``perf/train_setup_time`` (the rest: batch tensors, advantages,
        the drift check), and when they run ``perf/train_old_logprob_time`` (the no-grad pass of several
        mini-batches or KL), ``perf/train_ref_logprob_time``, ``perf/train_critic_time``. The train step of
        rollout step ``$VIME_PROFILE_TRAIN_STEP`` runs under ``torch.profiler`` (:mod:`vime_core.trainer.profile`).

    :raises LogprobDriftError: if ``--max-train-rollout-logprob-diff`` is exceeded (no update is made).
    :raises FloatingPointError: on a non-finite gradient norm.
    """
    with profiled(batch.step, backend):
        return _rl_train_step(backend, batch)


def _rl_train_step(backend: PolicyOps, batch: RolloutBatch) -> dict[str, float]:
    """The body of :func:`rl_train_step`."""
    t0 = time.perf_counter()
    cfg, algo = backend.trainer_config, backend.algorithm_config
    timer = StepTimer(backend.loss_device)
    samples = batch.samples
    gbs = cfg.global_batch_size or len(samples)
    minibatches = [samples[i : i + gbs] for i in range(0, len(samples), gbs)]
    step = _StepTensors.of(backend, batch, len(minibatches) > 1, timer)
    critic = backend.critic
    lr_schedule = policy_lr_schedule(cfg)
    lr_used: list[float] = []
    drift = None
    mismatch: dict[str, float] = {}
    sums: dict[str, float] = {}
    weight_total = 0.0
    grad_norms: list[float] = []
    critic_sums: dict[str, float] = {}
    timer.lap("setup")
    for minibatch in minibatches:
        if critic is not None:
            cm = critic.train_minibatch(
                list(micro_batches(minibatch, cfg.micro_batch_size)), step.old_values, step.returns_of, step.per_token
            )
            for k, v in cm.items():
                critic_sums[k] = critic_sums.get(k, 0.0) + v / len(minibatches)
            timer.lap("critic")
        if step.critic_only:
            continue
        weight_total += _policy_gradients(backend, step, minibatch, sums, timer)
        if drift is None:  # every sample's pre-update log-probs are known by now (the other DP ranks' shards: shared)
            share_across_dp(backend, samples, step.old_of)
            olds, rollouts, masks = (
                [of[id(s)] for s in samples] for of in (step.old_of, step.rollout_of, step.mask_of)
            )
            drift = check_logprob_drift(olds, rollouts, masks, algo.max_train_rollout_logprob_diff, backend.steps_done)
            if algo.get_mismatch_metrics:
                mismatch = mismatch_metrics(pad_batch(olds), pad_batch(rollouts), pad_batch(masks))
        timer.lap("setup")
        lr_used.append(lr_schedule.lr_at(backend.steps_done))
        set_lr(backend.optimizer, lr_used[-1])
        grad_norms.append(backend.optimizer_step())
        backend.steps_done += 1
        timer.lap("optimizer")
    if backend.dp_size > 1:  # the loss metrics of every DP rank's shard
        parts = backend.dp_all_gather((sums, weight_total))
        sums = {k: sum(p[0].get(k, 0.0) for p in parts) for k in sorted({k for p in parts for k in p[0]})}
        weight_total = sum(p[1] for p in parts)
    metrics = {f"train/{k}": v / max(weight_total, 1.0) for k, v in sums.items()}
    metrics.update({f"train/{k}": v for k, v in step.adv_metrics.items()})
    if drift is not None:
        metrics["train/train_rollout_logprob_abs_diff"] = drift
    metrics.update({f"train/mismatch/{k}": v for k, v in mismatch.items()})
    if grad_norms:
        metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
    # the learning rate of the step's last policy update (of the next one when the critic alone trained)
    metrics["train/lr"] = lr_used[-1] if lr_used else lr_schedule.lr_at(backend.steps_done)
    if critic is not None:
        metrics.update({f"train/{k}": v for k, v in critic_sums.items()})
        metrics["train/critic_lr"] = critic.lr
        metrics["train/critic_only"] = float(step.critic_only)
    metrics["train/num_tokens"] = float(batch.num_response_tokens())
    metrics["train/num_seq_tokens"] = float(sum(len(s.tokens) for s in samples))  # prompt + response: the FLOPs
    timer.lap("setup")
    metrics.update(timer.metrics())
    metrics["perf/train_compute_time"] = time.perf_counter() - t0
    return metrics


@dataclass
class _StepTensors:
    """What every mini-batch of one :func:`rl_train_step` reads, by ``id(sample)``: the engine's log-probs, the loss
    masks, the trainer's pre-update log-probs (``old_of``, filled by the first mini-batch when there is one only and
    no KL penalty), the reference model's, the advantages; with the critic its values, the returns and whether the
    step trains the critic only."""

    rollout_of: dict[int, torch.Tensor]
    mask_of: dict[int, torch.Tensor]
    old_of: dict[int, torch.Tensor]
    ref_of: dict[int, torch.Tensor]
    adv_of: dict[int, torch.Tensor]
    adv_metrics: dict[str, float]
    loss_options: PolicyLossOptions
    is_normalizer: float | None = None
    old_values: dict[int, torch.Tensor] | None = None
    returns_of: dict[int, torch.Tensor] | None = None
    critic_only: bool = False

    @property
    def per_token(self) -> bool:
        return self.loss_options.per_token

    @classmethod
    def of(cls, backend: PolicyOps, batch: RolloutBatch, several_minibatches: bool, timer: StepTimer) -> _StepTensors:
        """The step's log-probs (trainer-side old and reference ones split over the DP ranks), the KL penalty and
        the advantages (GAE with the critic's values for ``ppo``, else the estimator's, post-processed); each pass
        charged to its phase of ``timer``."""
        cfg, algo = backend.trainer_config, backend.algorithm_config
        samples = batch.samples
        rollout_of = {id(s): torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples}
        mask_of = {id(s): torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples}
        kl_coef = algo.kl_coef
        # trainer-side behaviour-policy log-probs, before any update (else filled by the first, only, mini-batch)
        old_of = {}
        options = PolicyLossOptions.from_config(algo)
        settings = correction_settings(options)
        normalize = settings is not None and settings.tis_mode is not None and settings.batch_normalize
        timer.lap("setup")
        if several_minibatches or kl_coef != 0.0 or normalize:
            old_of = dp_log_probs(backend, samples, lambda part: old_log_probs(backend, part))
            timer.lap("old_logprob")
        ref_of = {}
        if backend.ref_model is not None:
            ref = backend.ref_model
            ref_of = dp_log_probs(backend, samples, lambda part: ref.log_probs(part, cfg.micro_batch_size))
            timer.lap("ref_logprob")
        kl = None
        if kl_coef != 0.0:
            behaviour = rollout_of if algo.use_rollout_logprobs else old_of
            kl = [approx_kl(behaviour[id(s)], ref_of[id(s)], algo.kl_loss_type) for s in samples]
        estimator_out = [torch.tensor(a, dtype=torch.float32) for a in batch.advantages]
        out = cls(rollout_of, mask_of, old_of, ref_of, {}, {}, options)
        if normalize:  # --tis-batch-normalize: the mean weight of the whole step's batch, every DP rank's alike
            rows = [pad_batch([of[id(s)] for s in samples]) for of in (old_of, rollout_of, mask_of)]
            out.is_normalizer = rollout_correction(*rows, settings).metrics["tis_batch_norm_factor"]
        if backend.critic is not None:  # ppo: the estimator gave per-token rewards; GAE with the critic's values
            out.old_values = old_values = backend.critic.values(samples, cfg.micro_batch_size)
            timer.lap("critic")
            advantages, returns, out.adv_metrics = gae_advantages(
                algo, samples, estimator_out, [old_values[id(s)] for s in samples], kl=kl
            )
            out.returns_of = {id(s): r for s, r in zip(samples, returns, strict=True)}
            out.critic_only = batch.step < algo.num_critic_only_steps
        else:
            advantages, out.adv_metrics = postprocess_advantages(algo, samples, estimator_out, kl=kl)
        out.adv_of = {id(s): a for s, a in zip(samples, advantages, strict=True)}
        return out


def _policy_gradients(
    backend: PolicyOps, step: _StepTensors, minibatch: list[Sample], sums: dict[str, float], timer: StepTimer
) -> float:
    """Accumulate the policy loss's gradients of ``minibatch`` (this DP rank's shard of it, micro-batch by
    micro-batch, each weighted by its share of the mini-batch's trained tokens or samples) and add each micro-batch's
    loss metrics × its weight to ``sums``; the passes charged to ``timer``'s ``forward`` and ``backward`` phases.

    :return: the summed weight of this rank's micro-batches.
    """
    cfg, algo = backend.trainer_config, backend.algorithm_config
    dev, dp_size = backend.loss_device, backend.dp_size
    use_rollout = bool(algo.use_rollout_logprobs)
    use_kl_loss = bool(algo.use_kl_loss)
    per_token = step.per_token

    def weight(group: list[Sample]) -> int:  # the loss's denominator: trained tokens, or trained samples
        return sum(sum(s.loss_mask) for s in group) if per_token else sum(1 for s in group if any(s.loss_mask))

    def on(dev_of: dict[int, torch.Tensor], mb: list[Sample]) -> list[torch.Tensor]:
        return [dev_of[id(s)].to(dev) for s in mb]

    total = weight(minibatch)  # global: every DP rank holds the whole mini-batch
    weight_total = 0.0
    backend.zero_grad()
    for mb in micro_batches(dp_shard(minibatch, backend.dp_rank, dp_size), cfg.micro_batch_size):
        timer.lap("setup")
        lps, ents = backend.policy_log_probs(mb, True)
        lps = [lp.float() for lp in lps]
        for s, lp in zip(mb, lps, strict=True):
            if id(s) not in step.old_of:
                step.old_of[id(s)] = lp.detach().cpu()
        train_old = on(step.old_of, mb)
        out = policy_loss(
            lps,
            on(step.rollout_of, mb) if use_rollout else train_old,
            on(step.adv_of, mb),
            on(step.mask_of, mb),
            step.loss_options,
            rollout_log_probs=on(step.rollout_of, mb),
            train_old_log_probs=train_old,
            entropies=None if ents is None else [e.float() for e in ents],
            ref_log_probs=on(step.ref_of, mb) if use_kl_loss else None,
            is_normalizer=step.is_normalizer,
        )
        count = weight(mb)
        timer.lap("forward")
        if count == 0:
            continue
        # × dp_size: the backend's gradient reduction averages over the DP ranks (see the module docstring)
        (out.loss * (count * dp_size / total)).backward()
        timer.lap("backward")
        for k, v in out.metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v) * count
        weight_total += count
    return weight_total
