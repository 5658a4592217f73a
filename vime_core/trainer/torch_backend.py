"""``torch`` trainer backend: a Hugging Face causal LM trained with a torch optimizer (fp32 on CPU by default).

The loss is :func:`vime_core.algorithms.policy_loss.policy_loss` — the same code every backend uses.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from vime_core.algorithms.logprobs import token_log_probs
from vime_core.algorithms.policy_loss import policy_loss
from vime_core.trainer.base import TrainerBackend
from vime_core.types import RolloutBatch, Sample

logger = logging.getLogger("vime.trainer")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchTrainer(TrainerBackend):
    """HF model + AdamW; gradient accumulation over micro-batches of right-padded sequences.

    One optimizer step per mini-batch of ``--global-batch-size`` samples (default: the whole rollout, i.e. one
    step per rollout, where the old policy equals the current one and the PPO ratio is exactly 1). With more than
    one mini-batch, the old-policy log-probs are computed before the first update.
    """

    NAME = "torch"

    def __init__(self, args: argparse.Namespace, model_path: Path) -> None:
        super().__init__(args, model_path)
        from transformers import AutoModelForCausalLM

        torch.manual_seed(args.seed)
        if getattr(args, "train_num_threads", None):
            torch.set_num_threads(args.train_num_threads)
        self.device = torch.device(args.train_device)
        dtype = DTYPES[args.train_dtype]
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), torch_dtype=dtype).to(self.device)
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
        self.steps_done = 0

    # -- forward -------------------------------------------------------------------------------------------------
    def _response_log_probs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Log-probs of each sample's response tokens, ``[response_length]`` float32 each (graph attached)."""
        max_len = max(len(s.tokens) for s in samples)
        ids = torch.zeros((len(samples), max_len), dtype=torch.long)
        attn = torch.zeros((len(samples), max_len), dtype=torch.long)
        for i, s in enumerate(samples):
            ids[i, : len(s.tokens)] = torch.tensor(s.tokens, dtype=torch.long)
            attn[i, : len(s.tokens)] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        logits = self.model(input_ids=ids, attention_mask=attn).logits
        lp = token_log_probs(logits, ids)  # [B, L-1]
        out = []
        for i, s in enumerate(samples):
            start = s.prompt_length - 1
            out.append(lp[i, start : start + s.response_length])
        return out

    def _micro_batches(self, samples: list[Sample]) -> Iterator[list[Sample]]:
        mbs = self.args.micro_batch_size
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].tokens))  # less padding
        for i in range(0, len(order), mbs):
            yield [samples[j] for j in order[i : i + mbs]]

    # -- training ------------------------------------------------------------------------------------------------
    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """One RL step on ``batch``: ``ceil(len / global_batch_size)`` optimizer steps.

        :return: metrics ``train/pg_loss``, ``train/pg_clipfrac``, ``train/ppo_kl``, ``train/grad_norm``,
            ``train/train_rollout_logprob_abs_diff``, ``train/lr``, ``train/num_tokens``.
        """
        t0 = time.perf_counter()
        samples = batch.samples
        adv_of = {id(s): torch.tensor(a, dtype=torch.float32) for s, a in zip(samples, batch.advantages)}
        gbs = self.args.global_batch_size or len(samples)
        minibatches = [samples[i : i + gbs] for i in range(0, len(samples), gbs)]
        old_of: dict[int, torch.Tensor] = {}
        if len(minibatches) > 1 and not self.args.use_rollout_logprobs:
            with torch.no_grad():
                for mb in self._micro_batches(samples):
                    for s, lp in zip(mb, self._response_log_probs(mb)):
                        old_of[id(s)] = lp.float().cpu()
        sums: dict[str, float] = {}
        weight_total = 0.0
        grad_norms = []
        for minibatch in minibatches:
            per_token = self.args.calculate_per_token_loss
            total = sum(sum(s.loss_mask) for s in minibatch) if per_token else sum(1 for s in minibatch if any(s.loss_mask))
            self.optimizer.zero_grad(set_to_none=True)
            for mb in self._micro_batches(minibatch):
                lps = self._response_log_probs(mb)
                lps_cpu = [lp.float().cpu() for lp in lps]
                if self.args.use_rollout_logprobs:
                    olds = [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in mb]
                else:
                    olds = [old_of.get(id(s), lp.detach()) for s, lp in zip(mb, lps_cpu)]
                out = policy_loss(
                    lps_cpu,
                    olds,
                    [adv_of[id(s)] for s in mb],
                    [torch.tensor(s.loss_mask, dtype=torch.float32) for s in mb],
                    eps_clip=self.args.eps_clip,
                    eps_clip_high=self.args.eps_clip_high,
                    per_token=per_token,
                    rollout_log_probs=[torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in mb],
                )
                count = sum(sum(s.loss_mask) for s in mb) if per_token else sum(1 for s in mb if any(s.loss_mask))
                if count == 0:
                    continue
                (out.loss * (count / total)).backward()
                for k, v in out.metrics.items():
                    sums[k] = sums.get(k, 0.0) + v * count
                weight_total += count
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip_grad)
            if not math.isfinite(float(grad_norm)):
                raise FloatingPointError(f"non-finite grad norm {float(grad_norm)} at train step {self.steps_done}")
            grad_norms.append(float(grad_norm))
            self.optimizer.step()
            self.steps_done += 1
        metrics = {f"train/{k}": v / max(weight_total, 1.0) for k, v in sums.items()}
        metrics["train/grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        metrics["train/lr"] = self.args.lr
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
        """Weights as safetensors (HF names) plus ``optimizer.pt`` and ``trainer_state.pt``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(dict(self.named_hf_tensors()), str(path / "model.safetensors"))
        torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
        torch.save({"steps_done": self.steps_done, "rng": torch.get_rng_state()}, path / "trainer_state.pt")

    def load_checkpoint(self, path: Path) -> None:
        """Restore weights, optimizer and RNG state written by :meth:`save_checkpoint`.

        :raises FileNotFoundError: if a file is missing.
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
        ts = torch.load(path / "trainer_state.pt", weights_only=False)
        self.steps_done = ts["steps_done"]
        torch.set_rng_state(ts["rng"])
