"""``torch`` trainer backend: a Hugging Face causal LM trained with a torch optimizer (fp32 on CPU by default).

Every algorithm is shared code (:mod:`vime_core.algorithms`); this backend only supplies log-probs and entropies:
:func:`~vime_core.algorithms.batch.postprocess_advantages` (KL shaping, batch whitening),
:func:`~vime_core.algorithms.policy_loss.policy_loss` (PPO/GSPO surrogate, dual clip, TIS/MIS, entropy, KL loss)
and :func:`~vime_core.algorithms.mismatch.check_logprob_drift` (the drift budget). With ``--advantage-estimator
ppo`` a :class:`~vime_core.trainer.critic.Critic` (value head on a copy of the policy) is trained alongside:
:func:`~vime_core.algorithms.batch.gae_advantages` and :func:`~vime_core.algorithms.gae.value_loss`.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from vime_core.algorithms.batch import gae_advantages, postprocess_advantages
from vime_core.algorithms.kl import approx_kl
from vime_core.algorithms.logprobs import token_log_probs, token_log_probs_and_entropy
from vime_core.algorithms.mismatch import check_logprob_drift
from vime_core.algorithms.options import check_algorithm_args, kl_enabled, opt, uses_critic
from vime_core.algorithms.policy_loss import policy_loss, policy_loss_kwargs
from vime_core.trainer.base import TrainerBackend
from vime_core.types import RolloutBatch, Sample

logger = logging.getLogger("vime.trainer")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def response_log_probs(
    model: torch.nn.Module, samples: list[Sample], device: torch.device, with_entropy: bool = False
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """One batched forward pass of ``samples``; the log-probs (and entropies) of each sample's response tokens.

    Sequences are left-padded (explicit ``position_ids``) so every response ends at the last position, and the LM
    head runs only on the last ``max(response_length) + 1`` positions (``logits_to_keep``): the
    ``[batch, seq, vocab]`` logits of the whole sequence are never materialised.

    :param model: an HF causal LM (policy or reference).
    :param samples: the samples (``tokens`` = prompt + response).
    :param device: where ``model`` lives.
    :param with_entropy: also return each response token's next-token entropy (nats).
    :return: ``(log_probs, entropies)``: one ``[response_length]`` float32 tensor per sample each (graph attached
        when grad is enabled; on ``device``); ``entropies`` is None unless ``with_entropy``.
    """
    max_len = max(len(s.tokens) for s in samples)
    ids = torch.zeros((len(samples), max_len), dtype=torch.long)
    attn = torch.zeros((len(samples), max_len), dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, max_len - len(s.tokens) :] = torch.tensor(s.tokens, dtype=torch.long)
        attn[i, max_len - len(s.tokens) :] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    keep = max(s.response_length for s in samples) + 1
    ids, attn, pos = ids.to(device), attn.to(device), pos.to(device)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=keep).logits
    tail = ids[:, max_len - keep :]  # the tokens at the last keep positions
    if with_entropy:
        lp, ent = token_log_probs_and_entropy(logits, tail)  # [B, keep - 1] each
    else:
        lp, ent = token_log_probs(logits, tail), None

    def responses(x: torch.Tensor) -> list[torch.Tensor]:
        return [x[i, x.shape[1] - s.response_length :] for i, s in enumerate(samples)]

    return responses(lp), None if ent is None else responses(ent)


class ReferenceModel:
    """The frozen reference policy for KL (``--ref-load``: an HF directory or a known model name; default: the
    initial policy), on the trainer's device and dtype. Loaded only when KL is enabled.
    """

    def __init__(self, args: argparse.Namespace, model_path: Path, device: torch.device, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        path = Path(opt(args, "ref_load") or model_path)
        if not (path / "config.json").is_file():
            from vime_core.models import resolve_model

            path = resolve_model(str(opt(args, "ref_load")))
        self.path = path
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=dtype).to(device)
        self.model.eval()
        self.model.requires_grad_(False)

    @torch.no_grad()
    def log_probs(self, samples: list[Sample], micro_batch_size: int) -> dict[int, torch.Tensor]:
        """Reference log-probs of every sample's response, keyed by ``id(sample)`` (float32, CPU, no grad)."""
        out: dict[int, torch.Tensor] = {}
        for i in range(0, len(samples), micro_batch_size):
            mb = samples[i : i + micro_batch_size]
            for s, lp in zip(mb, response_log_probs(self.model, mb, self.device)[0], strict=True):
                out[id(s)] = lp.float().cpu()
        return out


class TorchTrainer(TrainerBackend):
    """HF model + AdamW; gradient accumulation over micro-batches of right-padded sequences.

    One optimizer step per mini-batch of ``--global-batch-size`` samples (default: the whole rollout, i.e. one
    step per rollout, where the old policy equals the current one and the PPO ratio is exactly 1). With more than
    one mini-batch, or with KL reward shaping, the old-policy log-probs are computed before the first update. With
    KL enabled (``--use-kl-loss`` or ``--kl-coef``) a frozen :class:`ReferenceModel` supplies reference log-probs.
    With ``--advantage-estimator ppo`` a :class:`~vime_core.trainer.critic.Critic` takes one optimizer step per
    mini-batch next to the policy's (only the critic's during the first ``--num-critic-only-steps`` steps).
    """

    NAME = "torch"

    def __init__(self, args: argparse.Namespace, model_path: Path) -> None:
        super().__init__(args, model_path)
        from transformers import AutoModelForCausalLM

        check_algorithm_args(args)

        torch.manual_seed(args.seed)
        # Ray starts actors with OMP_NUM_THREADS=1 (num_cpus=0 actors), which halves CPU training speed on 2 cores:
        # use every core this process may run on unless --train-num-threads says otherwise.
        torch.set_num_threads(getattr(args, "train_num_threads", None) or len(os.sched_getaffinity(0)))
        self.device = torch.device(args.train_device)
        dtype = DTYPES[args.train_dtype]
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(self.device)
        self.model.train()
        if getattr(args, "gradient_checkpointing", False):
            self.model.gradient_checkpointing_enable()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=args.lr,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps,
            weight_decay=args.weight_decay,
        )
        self.ref_model = ReferenceModel(args, self.model_path, self.device, dtype) if kl_enabled(args) else None
        self.critic = None
        if uses_critic(args):
            from vime_core.trainer.critic import Critic

            self.critic = Critic(args, self.model_path, self.device, dtype)
        self.steps_done = 0

    # -- forward -------------------------------------------------------------------------------------------------
    def _response_log_probs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Log-probs of each sample's response tokens, ``[response_length]`` float32 each (graph attached); see
        :func:`response_log_probs`."""
        return response_log_probs(self.model, samples, self.device)[0]

    @torch.no_grad()
    def _old_log_probs(self, samples: list[Sample]) -> dict[int, torch.Tensor]:
        """Current-policy log-probs of every sample before any update, keyed by ``id(sample)`` (float32, CPU)."""
        out: dict[int, torch.Tensor] = {}
        for mb in self._micro_batches(samples):
            for s, lp in zip(mb, self._response_log_probs(mb), strict=True):
                out[id(s)] = lp.float().cpu()
        return out

    def _micro_batches(self, samples: list[Sample]) -> Iterator[list[Sample]]:
        mbs = self.args.micro_batch_size
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].tokens))  # less padding
        for i in range(0, len(order), mbs):
            yield [samples[j] for j in order[i : i + mbs]]

    # -- training ------------------------------------------------------------------------------------------------
    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """One RL step on ``batch``: ``ceil(len / global_batch_size)`` optimizer steps.

        Order: old-policy and reference log-probs (when needed) → batch-level advantages (KL shaping, whitening;
        with ``ppo``: the critic's values and GAE) → per mini-batch: forward, :func:`policy_loss`, backward (then,
        with ``ppo``, the critic's value-loss step); the drift budget is checked before the first optimizer step.
        With ``ppo`` and ``batch.step < --num-critic-only-steps`` only the critic is updated.

        :return: metrics ``train/loss``, ``train/pg_loss``, ``train/pg_clipfrac``, ``train/ppo_kl``,
            ``train/entropy_loss``, ``train/grad_norm``, ``train/train_rollout_logprob_abs_diff`` (exact token mean
            over the batch, before the update), ``train/lr``, ``train/num_tokens``, ``train/adv/*``, and when enabled
            ``train/kl_loss``, ``train/tis``, ``train/tis_clipfrac``, ``train/pg_dual_clipfrac``; with ``ppo``
            ``train/value_loss``, ``train/value_clipfrac``, ``train/critic_grad_norm``, ``train/critic_lr``,
            ``train/critic/values_mean``, ``train/critic/returns_mean``, ``train/critic_only``.
        :raises LogprobDriftError: if ``--max-train-rollout-logprob-diff`` is exceeded (no update is made).
        :raises FloatingPointError: on a non-finite gradient norm.
        """
        t0 = time.perf_counter()
        args = self.args
        samples = batch.samples
        use_rollout = bool(opt(args, "use_rollout_logprobs"))
        rollout_of = {id(s): torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples}
        mask_of = {id(s): torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples}
        gbs = args.global_batch_size or len(samples)
        minibatches = [samples[i : i + gbs] for i in range(0, len(samples), gbs)]
        kl_coef = opt(args, "kl_coef")

        # trainer-side behaviour-policy log-probs, before any update (else filled by the first, only, mini-batch)
        old_of = self._old_log_probs(samples) if len(minibatches) > 1 or kl_coef != 0.0 else {}
        ref_of = self.ref_model.log_probs(samples, args.micro_batch_size) if self.ref_model is not None else {}
        kl = None
        if kl_coef != 0.0:
            behaviour = rollout_of if use_rollout else old_of
            kl = [approx_kl(behaviour[id(s)], ref_of[id(s)], opt(args, "kl_loss_type")) for s in samples]
        estimator_out = [torch.tensor(a, dtype=torch.float32) for a in batch.advantages]
        critic_only = False
        if self.critic is not None:  # ppo: the estimator gave per-token rewards; GAE with the critic's values
            old_values = self.critic.values(samples, args.micro_batch_size)
            advantages, returns, adv_metrics = gae_advantages(
                args, samples, estimator_out, [old_values[id(s)] for s in samples], kl=kl
            )
            returns_of = {id(s): r for s, r in zip(samples, returns, strict=True)}
            critic_only = batch.step < opt(args, "num_critic_only_steps")
        else:
            advantages, adv_metrics = postprocess_advantages(args, samples, estimator_out, kl=kl)
        adv_of = {id(s): a for s, a in zip(samples, advantages, strict=True)}
        loss_kwargs = policy_loss_kwargs(args)
        use_kl_loss = bool(opt(args, "use_kl_loss"))

        drift = None
        sums: dict[str, float] = {}
        weight_total = 0.0
        grad_norms = []
        per_token = loss_kwargs["per_token"]

        def weight(group: list[Sample]) -> int:  # the loss's denominator: trained tokens, or trained samples
            return sum(sum(s.loss_mask) for s in group) if per_token else sum(1 for s in group if any(s.loss_mask))

        critic_sums: dict[str, float] = {}
        for minibatch in minibatches:
            if self.critic is not None:
                mbs = list(self._micro_batches(minibatch))
                cm = self.critic.train_minibatch(mbs, old_values, returns_of, per_token)
                for k, v in cm.items():
                    critic_sums[k] = critic_sums.get(k, 0.0) + v / len(minibatches)
            if critic_only:
                continue
            total = weight(minibatch)
            self.optimizer.zero_grad(set_to_none=True)
            for mb in self._micro_batches(minibatch):
                lps, ents = response_log_probs(self.model, mb, self.device, with_entropy=True)
                lps_cpu = [lp.float().cpu() for lp in lps]
                for s, lp in zip(mb, lps_cpu, strict=True):
                    old_of.setdefault(id(s), lp.detach())
                train_old = [old_of[id(s)] for s in mb]
                out = policy_loss(
                    lps_cpu,
                    [rollout_of[id(s)] for s in mb] if use_rollout else train_old,
                    [adv_of[id(s)] for s in mb],
                    [mask_of[id(s)] for s in mb],
                    rollout_log_probs=[rollout_of[id(s)] for s in mb],
                    train_old_log_probs=train_old,
                    entropies=[e.float().cpu() for e in ents],
                    ref_log_probs=[ref_of[id(s)] for s in mb] if use_kl_loss else None,
                    **loss_kwargs,
                )
                count = weight(mb)
                if count == 0:
                    continue
                (out.loss * (count / total)).backward()
                for k, v in out.metrics.items():
                    sums[k] = sums.get(k, 0.0) + v * count
                weight_total += count
            if drift is None:  # every sample's pre-update log-probs are known by now
                drift = check_logprob_drift(
                    [old_of[id(s)] for s in samples],
                    [rollout_of[id(s)] for s in samples],
                    [mask_of[id(s)] for s in samples],
                    opt(args, "max_train_rollout_logprob_diff"),
                    step=self.steps_done,
                )
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip_grad)
            if not math.isfinite(float(grad_norm)):
                raise FloatingPointError(f"non-finite grad norm {float(grad_norm)} at train step {self.steps_done}")
            grad_norms.append(float(grad_norm))
            self.optimizer.step()
            self.steps_done += 1
        metrics = {f"train/{k}": v / max(weight_total, 1.0) for k, v in sums.items()}
        metrics.update({f"train/{k}": v for k, v in adv_metrics.items()})
        if drift is not None:
            metrics["train/train_rollout_logprob_abs_diff"] = drift
        if grad_norms:
            metrics["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
        metrics["train/lr"] = self.args.lr
        if self.critic is not None:
            metrics.update({f"train/{k}": v for k, v in critic_sums.items()})
            metrics["train/critic_lr"] = self.critic.lr
            metrics["train/critic_only"] = float(critic_only)
        metrics["train/num_tokens"] = float(batch.num_response_tokens())
        metrics["perf/train_compute_time"] = time.perf_counter() - t0
        return metrics

    # -- weights ---------------------------------------------------------------------------------------------------
    def named_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF names and tensors (detached, CPU, contiguous); a tied ``lm_head.weight`` is left out (vLLM ties it)."""
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        for name, tensor in self.model.state_dict().items():
            if tied and name == "lm_head.weight":
                continue
            yield name, tensor.detach().to("cpu").contiguous()

    def save_hf(self, path: Path) -> None:
        """``save_pretrained`` of model (safetensors) and tokenizer to ``path``."""
        from transformers import AutoTokenizer

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(path), safe_serialization=True)
        AutoTokenizer.from_pretrained(str(self.model_path)).save_pretrained(str(path))
        gen = self.model_path / "generation_config.json"
        if gen.exists() and not (path / "generation_config.json").exists():
            (path / "generation_config.json").write_bytes(gen.read_bytes())

    def save_checkpoint(self, path: Path) -> None:
        """Weights as safetensors (HF names) plus ``optimizer.pt`` and ``trainer_state.pt``; with ``ppo`` the critic
        (weights and optimizer) under ``critic/`` (:meth:`~vime_core.trainer.critic.Critic.save`)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(dict(self.named_hf_tensors()), str(path / "model.safetensors"))
        torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
        if self.critic is not None:
            self.critic.save(path / "critic")
        torch.save({"steps_done": self.steps_done, "rng": torch.get_rng_state()}, path / "trainer_state.pt")

    def load_checkpoint(self, path: Path) -> None:
        """Restore weights, optimizer and RNG state (and the critic, with ``ppo``) written by :meth:`save_checkpoint`.

        :raises FileNotFoundError: if a file is missing (the critic's included).
        """
        from safetensors.torch import load_file

        path = Path(path)
        state = load_file(str(path / "model.safetensors"))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [m for m in missing if m != "lm_head.weight"]
        if missing or unexpected:
            raise ValueError(f"checkpoint {path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
        if self.critic is not None:
            self.critic.load(path / "critic")
        ts = torch.load(path / "trainer_state.pt", weights_only=False)
        self.steps_done = ts["steps_done"]
        torch.set_rng_state(ts["rng"])
