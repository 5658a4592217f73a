"""``megatron`` trainer backend: a megatron-core ``GPTModel`` (bf16, ``Float16Module``, Megatron DDP and distributed
optimizer) trained with the same :func:`vime_core.algorithms.policy_loss.policy_loss` as the torch backend.

* Needs a CUDA GPU and ``megatron-core`` (0.16+; tested with 0.19.2 on an H200, Python 3.12, torch 2.11). No Ray: the
  backend initialises ``torch.distributed`` itself (from torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_*`` when set,
  else a one-process group on 127.0.0.1), so the orchestration layer can wrap it but it does not depend on it.
* Layer spec: Transformer Engine's when ``transformer_engine`` imports (``--megatron-attention te``), else
  Megatron's local spec with the core attention swapped for :class:`SDPACoreAttention` (``torch``'s
  ``scaled_dot_product_attention``, flash kernels on Hopper; ``--megatron-attention sdpa``, the default) or left as
  Megatron's unfused ``DotProductAttention`` (``--megatron-attention local``).
* Weights: HF checkpoints of the Llama family (Llama, SmolLM2, Mistral-dense) and Qwen2 are mapped by
  :mod:`vime_core.trainer.megatron_convert` (bit-exact both ways); :meth:`MegatronTrainer.named_hf_tensors` gathers
  tensor-parallel shards and exports HF names/shapes for vLLM.
* Parallelism: tensor parallelism (``--tensor-model-parallel-size``; ``--sequence-parallel`` with TE only: the local
  spec's torch norms do not support it) and data parallelism over the remaining ranks. Pipeline and context
  parallelism are refused with a clear error (not implemented in the weight export yet).
* On CPU megatron-core's model code calls ``torch.cuda`` unconditionally (global memory buffer, RNG tracker,
  rotary embeddings); the backend raises :class:`RuntimeError` there instead of shimming it.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from vime_core.algorithms.policy_loss import policy_loss
from vime_core.trainer.base import TrainerBackend
from vime_core.trainer.megatron_convert import (
    ArchConfig,
    hf_to_megatron,
    megatron_to_hf,
    pad_vocab,
    shard,
    unpad_vocab,
    unshard,
)
from vime_core.types import RolloutBatch, Sample

logger = logging.getLogger("vime.trainer")


def have_transformer_engine() -> bool:
    """Whether ``transformer_engine.pytorch`` imports."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "no TE"
        return False
    return True


def init_distributed(timeout_minutes: int = 30) -> tuple[int, int, int]:
    """Initialise ``torch.distributed`` (NCCL) if needed: torchrun's environment, or a one-process group.

    :return: ``(rank, world_size, local_rank)``; the current CUDA device is set to ``local_rank``.
    :raises RuntimeError: without CUDA.
    """
    import datetime

    import torch.distributed as dist

    if not torch.cuda.is_available():
        raise RuntimeError(
            "the megatron trainer needs a CUDA GPU: megatron-core's model code calls torch.cuda "
            "unconditionally (use --trainer torch on CPU)"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            from vime_core.rollout.engine import find_free_port

            os.environ.update(
                RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port())
            )
        dist.init_process_group(
            "nccl", timeout=datetime.timedelta(minutes=timeout_minutes), device_id=torch.device("cuda", local_rank)
        )
    return dist.get_rank(), dist.get_world_size(), local_rank


class SDPACoreAttention(torch.nn.Module):
    """Megatron core-attention module (the ``core_attention`` submodule of ``SelfAttention``) computed with
    ``torch.nn.functional.scaled_dot_product_attention``.

    Same interface as ``megatron.core.transformer.dot_product_attention.DotProductAttention``: ``query``
    ``[sq, b, np, hn]``, ``key``/``value`` ``[sk, b, ng, hn]`` (bf16), returns ``[sq, b, np * hn]``. Causal masks
    are implicit (``is_causal``); an explicit Megatron mask (``True`` = masked out) is inverted for SDPA. Context
    parallelism and packed sequences are not supported.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        **_: Any,
    ) -> None:
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        if getattr(config, "context_parallel_size", 1) != 1:
            raise ValueError("SDPACoreAttention does not support context parallelism")
        self.config = config
        self.causal = attn_mask_type == AttnMaskType.causal
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
        **_: Any,
    ) -> torch.Tensor:
        import torch.nn.functional as F

        if packed_seq_params is not None:
            raise ValueError("SDPACoreAttention does not support packed sequences")
        sq, b, heads, hn = query.shape
        if key.shape[2] != heads:  # GQA: expand key/value groups (flash kernels want equal head counts)
            rep = heads // key.shape[2]
            key = key.repeat_interleave(rep, dim=2)
            value = value.repeat_interleave(rep, dim=2)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
        mask = None if (self.causal or attention_mask is None) else ~attention_mask
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.causal and mask is None,
            scale=self.scale,
        )
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)


def layer_spec(attention: str, te: bool) -> Any:
    """The transformer-layer ``ModuleSpec``: TE's (``attention == "te"``), or the local spec with SDPA (``"sdpa"``)
    or Megatron's own unfused attention (``"local"``).

    :raises ValueError: on an unknown ``attention`` or ``"te"`` without Transformer Engine.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if attention == "te":
        if not te:
            raise ValueError("--megatron-attention te needs transformer_engine, which does not import here")
        return specs.get_gpt_layer_with_transformer_engine_spec()
    if attention not in ("sdpa", "local"):
        raise ValueError(f"--megatron-attention must be te, sdpa or local, got {attention!r}")
    spec = specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


class MegatronTrainer(TrainerBackend):
    """megatron-core GPTModel + Megatron's distributed optimizer; one optimizer step per ``--global-batch-size``
    samples (default: the whole rollout), gradient accumulation over ``--micro-batch-size`` micro-batches.

    Arguments read from ``args`` (defaults in brackets): ``seed``, ``lr``, ``adam_beta1``, ``adam_beta2``,
    ``adam_eps``, ``weight_decay``, ``clip_grad``, ``global_batch_size`` [None], ``micro_batch_size``,
    ``use_rollout_logprobs``, ``calculate_per_token_loss``, ``eps_clip``, ``eps_clip_high``, and Megatron's own
    ``tensor_model_parallel_size`` [1], ``pipeline_model_parallel_size`` [1], ``context_parallel_size`` [1],
    ``sequence_parallel`` [False], ``recompute_granularity`` [None], ``recompute_method`` [None],
    ``recompute_num_layers`` [None], ``use_distributed_optimizer`` [True], ``megatron_attention`` [te if TE
    imports, else sdpa].

    :raises RuntimeError: without CUDA. :raises NotImplementedError: for pipeline or context parallelism.
    :raises vime_core.trainer.megatron_convert.ConversionError: if the checkpoint is not a supported architecture.
    """

    NAME = "megatron"

    def __init__(self, args: argparse.Namespace, model_path: Path) -> None:
        super().__init__(args, model_path)
        from megatron.core import parallel_state as mpu
        from megatron.core import tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.module import Float16Module
        from transformers import AutoConfig

        from vime_core.algorithms.options import uses_critic

        if uses_critic(args):  # before any GPU/distributed setup, so the message comes at once
            raise NotImplementedError(
                "--advantage-estimator ppo needs a critic, which the megatron backend does not have yet: use "
                "--trainer torch (GAE and the value loss are shared code in vime_core.algorithms)"
            )
        self.rank, self.world, _ = init_distributed()
        self.tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
        pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
        cp = int(getattr(args, "context_parallel_size", 1) or 1)
        if pp != 1 or cp != 1:
            raise NotImplementedError(
                f"the megatron backend supports tensor and data parallelism only (got pipeline {pp}, context {cp})"
            )
        if getattr(args, "sequence_parallel", False) and self.tp > 1 and not have_transformer_engine():
            raise ValueError(
                "--sequence-parallel needs Transformer Engine: megatron-core's torch norms (local spec) "
                "do not support sequence parallelism"
            )
        if not mpu.model_parallel_is_initialized():
            mpu.initialize_model_parallel(tensor_model_parallel_size=self.tp)
        self.tp_rank = mpu.get_tensor_model_parallel_rank()
        self.tp_group = mpu.get_tensor_model_parallel_group()
        tensor_parallel.model_parallel_cuda_manual_seed(int(getattr(args, "seed", 0)))
        torch.manual_seed(int(getattr(args, "seed", 0)))

        self.hf_config = AutoConfig.from_pretrained(str(model_path))
        self.arch = ArchConfig.from_hf(self.hf_config)
        self.te = have_transformer_engine()
        self.attention = getattr(args, "megatron_attention", None) or ("te" if self.te else "sdpa")
        self.padded_vocab = math.ceil(self.arch.vocab_size / self.tp) * self.tp
        a = self.arch
        self.config = TransformerConfig(
            num_layers=a.num_layers,
            hidden_size=a.hidden_size,
            num_attention_heads=a.num_attention_heads,
            num_query_groups=a.num_query_groups,
            kv_channels=a.head_dim,
            ffn_hidden_size=a.ffn_hidden_size,
            normalization="RMSNorm",
            layernorm_epsilon=a.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            add_qkv_bias=a.qkv_bias,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            bf16=True,
            params_dtype=torch.bfloat16,
            pipeline_dtype=torch.bfloat16,
            tensor_model_parallel_size=self.tp,
            sequence_parallel=bool(getattr(args, "sequence_parallel", False)) and self.tp > 1,
            recompute_granularity=getattr(args, "recompute_granularity", None),
            recompute_method=getattr(args, "recompute_method", None),
            recompute_num_layers=getattr(args, "recompute_num_layers", None),
            masked_softmax_fusion=False,
            bias_activation_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            gradient_accumulation_fusion=False,
        )
        gpt = GPTModel(
            config=self.config,
            transformer_layer_spec=layer_spec(self.attention, self.te),
            vocab_size=self.padded_vocab,
            max_sequence_length=a.max_position_embeddings,
            pre_process=True,
            post_process=True,
            parallel_output=True,
            share_embeddings_and_output_weights=a.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(a.rope_theta),
            rotary_percent=1.0,
        )
        gpt.cuda(torch.cuda.current_device())
        self.gpt = gpt
        self.load_hf_weights(model_path)
        self.module = Float16Module(self.config, gpt)
        use_dist_opt = bool(getattr(args, "use_distributed_optimizer", True))
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=use_dist_opt
        )
        self.ddp = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=self.module)
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            adam_eps=args.adam_eps,
            clip_grad=args.clip_grad,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=use_dist_opt,
        )
        self.optimizer = get_megatron_optimizer(opt_config, [self.ddp])
        for group in self.optimizer.param_groups:  # constant lr (no scheduler)
            group["lr"] = args.lr
        self.steps_done = 0
        self.model = _HFStyleForward(self)  # the contract kit's view: model(input_ids=...).logits

    # -- weights -----------------------------------------------------------------------------------------------------
    def _read_hf(self, path: Path) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        from vime_core.rollout.worker_extension import safetensors_files

        out: dict[str, torch.Tensor] = {}
        for f in safetensors_files(path):
            out.update(load_file(str(f)))
        return out

    @torch.no_grad()
    def load_hf_tensors(self, hf: dict[str, torch.Tensor]) -> None:
        """Copy HF tensors (cast to bf16) into this rank's Megatron parameters (shards of them under TP).

        :raises ConversionError: on a missing/unexpected/mis-shaped tensor.
        :raises KeyError: if the mapping produces a name the model does not have (or misses one it has).
        """
        mc = pad_vocab(hf_to_megatron(hf, self.arch, te=self.attention == "te"), self.padded_vocab)
        params = dict(self.gpt.named_parameters())
        missing, unexpected = sorted(set(params) - set(mc)), sorted(set(mc) - set(params))
        if missing or unexpected:
            raise KeyError(
                f"HF→Megatron mapping does not fit the model: missing {missing[:6]}, unexpected {unexpected[:6]}"
            )
        for name, p in params.items():
            part = shard(name, mc[name], self.tp_rank, self.tp)
            if part.shape != p.shape:
                raise KeyError(f"{name}: mapped shard {tuple(part.shape)} vs parameter {tuple(p.shape)}")
            p.copy_(part.to(device=p.device, dtype=p.dtype))

    def load_hf_weights(self, path: Path) -> None:
        """Load an HF checkpoint directory into the model (call :meth:`reload_optimizer_params` afterwards once the
        optimizer exists)."""
        self.load_hf_tensors(self._read_hf(Path(path)))

    @torch.no_grad()
    def megatron_tensors(self) -> dict[str, torch.Tensor]:
        """Full (TP-gathered, unpadded) Megatron tensors on this rank's GPU."""
        import torch.distributed as dist

        out = {}
        for name, p in self.gpt.named_parameters():
            if self.tp > 1:
                parts = [torch.empty_like(p) for _ in range(self.tp)]
                dist.all_gather(parts, p.data.contiguous(), group=self.tp_group)
                out[name] = unshard(name, parts)
            else:
                out[name] = p.data
        return unpad_vocab(out, self.arch.vocab_size)

    def named_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF names and bf16 CPU tensors (contiguous); a tied ``lm_head.weight`` is left out, as in the torch
        backend. Every TP rank must iterate (the gather is collective)."""
        for name, t in megatron_to_hf(self.megatron_tensors(), self.arch, te=self.attention == "te").items():
            yield name, t.contiguous().to("cpu")

    # -- forward -----------------------------------------------------------------------------------------------------
    def _batch(self, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
        max_len = max(len(s.tokens) for s in samples)
        if self.config.sequence_parallel:
            max_len = math.ceil(max_len / self.tp) * self.tp
        ids = torch.zeros((len(samples), max_len), dtype=torch.long)
        for i, s in enumerate(samples):
            ids[i, : len(s.tokens)] = torch.tensor(s.tokens, dtype=torch.long)
        ids = ids.cuda(non_blocking=True)
        pos = torch.arange(max_len, device=ids.device).unsqueeze(0).expand_as(ids)
        return ids, pos

    def _vocab_parallel_logits(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``[b, s, padded_vocab / tp]`` float32 logits with padded vocabulary columns at ``-inf``."""
        logits = self.ddp(ids, pos, None).float()
        per = self.padded_vocab // self.tp
        first_pad = self.arch.vocab_size - self.tp_rank * per
        if first_pad < per:
            logits[..., max(first_pad, 0) :] = float("-inf")
        return logits

    def token_log_probs(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``[b, s - 1]`` float32 log-probs of each next token (vocab-parallel cross entropy; differentiable)."""
        from megatron.core import tensor_parallel

        logits = self._vocab_parallel_logits(ids, pos)[:, :-1].contiguous()
        return -tensor_parallel.vocab_parallel_cross_entropy(logits, ids[:, 1:].contiguous())

    def _response_log_probs(self, samples: list[Sample]) -> list[torch.Tensor]:
        ids, pos = self._batch(samples)
        lp = self.token_log_probs(ids, pos)
        return [lp[i, s.prompt_length - 1 : s.prompt_length - 1 + s.response_length] for i, s in enumerate(samples)]

    def _micro_batches(self, samples: list[Sample]) -> Iterator[list[Sample]]:
        mbs = self.args.micro_batch_size
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].tokens))
        for i in range(0, len(order), mbs):
            yield [samples[j] for j in order[i : i + mbs]]

    # -- training ----------------------------------------------------------------------------------------------------
    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """One RL step on ``batch`` (same semantics and metrics as the torch backend's ``train_step``).

        :raises FloatingPointError: on a non-finite gradient norm.
        """
        from megatron.core.distributed import finalize_model_grads

        t0 = time.perf_counter()
        dev = torch.device("cuda", torch.cuda.current_device())
        samples = batch.samples
        adv_of = {
            id(s): torch.tensor(a, dtype=torch.float32, device=dev)
            for s, a in zip(samples, batch.advantages, strict=True)
        }
        gbs = self.args.global_batch_size or len(samples)
        minibatches = [samples[i : i + gbs] for i in range(0, len(samples), gbs)]
        old_of: dict[int, torch.Tensor] = {}
        if len(minibatches) > 1 and not self.args.use_rollout_logprobs:
            with torch.no_grad():
                for mb in self._micro_batches(samples):
                    for s, lp in zip(mb, self._response_log_probs(mb), strict=True):
                        old_of[id(s)] = lp.detach()
        sums: dict[str, float] = {}
        weight_total = 0.0
        grad_norms = []
        per_token = self.args.calculate_per_token_loss
        for minibatch in minibatches:
            total = (
                sum(sum(s.loss_mask) for s in minibatch)
                if per_token
                else sum(1 for s in minibatch if any(s.loss_mask))
            )
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            for mb in self._micro_batches(minibatch):
                lps = self._response_log_probs(mb)
                if self.args.use_rollout_logprobs:
                    olds = [torch.tensor(s.rollout_log_probs, dtype=torch.float32, device=dev) for s in mb]
                else:
                    olds = [old_of.get(id(s), lp.detach()) for s, lp in zip(mb, lps, strict=True)]
                out = policy_loss(
                    lps,
                    olds,
                    [adv_of[id(s)] for s in mb],
                    [torch.tensor(s.loss_mask, dtype=torch.float32, device=dev) for s in mb],
                    eps_clip=self.args.eps_clip,
                    eps_clip_high=self.args.eps_clip_high,
                    per_token=per_token,
                    rollout_log_probs=[torch.tensor(s.rollout_log_probs, dtype=torch.float32, device=dev) for s in mb],
                )
                count = sum(sum(s.loss_mask) for s in mb) if per_token else sum(1 for s in mb if any(s.loss_mask))
                if count == 0:
                    continue
                (out.loss * (count / total)).backward()
                for k, v in out.metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v) * count
                weight_total += count
            finalize_model_grads([self.ddp])  # DP reduce-scatter + SP layernorm grads across TP
            ok, grad_norm, _ = self.optimizer.step()
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
            if not ok or not math.isfinite(grad_norm):
                raise FloatingPointError(f"non-finite grad norm {grad_norm} at train step {self.steps_done}")
            grad_norms.append(grad_norm)
            self.steps_done += 1
        metrics = {f"train/{k}": v / max(weight_total, 1.0) for k, v in sums.items()}
        metrics["train/grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        metrics["train/lr"] = self.args.lr
        metrics["train/num_tokens"] = float(batch.num_response_tokens())
        torch.cuda.synchronize()
        metrics["perf/train_compute_time"] = time.perf_counter() - t0
        return metrics

    # -- checkpoints -------------------------------------------------------------------------------------------------
    def save_hf(self, path: Path) -> None:
        """Write an HF directory: ``config.json`` (``torch_dtype`` bfloat16), tokenizer files, ``model.safetensors``.
        Collective under TP: every rank calls it, rank 0 writes."""
        import shutil

        from safetensors.torch import save_file

        tensors = dict(self.named_hf_tensors())
        if self.rank != 0:
            return
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        for f in self.model_path.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, path / f.name)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})

    def save_checkpoint(self, path: Path) -> None:
        """HF-layout weights + Megatron optimizer state (``optimizer.pt`` and the distributed optimizer's
        ``optimizer_param_state.pt``; none before the first optimizer step) + ``trainer_state.pt``. Collective:
        every rank calls it."""
        import torch.distributed as dist

        path = Path(path)
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        tensors = dict(self.named_hf_tensors())
        if self.rank == 0:
            from safetensors.torch import save_file

            save_file(tensors, str(path / "model.safetensors"))
            if self.steps_done:
                torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
            torch.save(
                {"steps_done": self.steps_done, "rng": torch.get_rng_state(), "cuda_rng": torch.cuda.get_rng_state()},
                path / "trainer_state.pt",
            )
        if self.steps_done:
            self.optimizer.save_parameter_state(str(path / "optimizer_param_state.pt"))
        dist.barrier()

    def _inner_optimizers(self) -> list[Any]:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def load_checkpoint(self, path: Path) -> None:
        """Restore what :meth:`save_checkpoint` wrote (weights, optimizer state, RNG); a checkpoint from before the
        first optimizer step restores a fresh optimizer.

        :raises FileNotFoundError: if a file is missing.
        """
        from safetensors.torch import load_file

        path = Path(path)
        self.load_hf_tensors(load_file(str(path / "model.safetensors")))
        self.optimizer.reload_model_params()  # fp32 main params <- the loaded bf16 weights
        if (path / "optimizer.pt").exists():
            self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
            # megatron-core 0.19.2 with torch's AdamW (no apex / TE): load_state_dict puts the common "step" into
            # every parameter state, which load_parameter_state then looks for in the file (KeyError 'step');
            # set it aside around that call
            steps = [
                (st, st.pop("step"))
                for opt in self._inner_optimizers()
                for st in getattr(getattr(opt, "optimizer", None), "state", {}).values()
                if "step" in st
            ]
            try:
                self.optimizer.load_parameter_state(str(path / "optimizer_param_state.pt"))
            finally:
                for st, step in steps:
                    st["step"] = step
        else:
            for opt in self._inner_optimizers():
                inner = getattr(opt, "optimizer", None)
                if inner is not None:
                    inner.state.clear()  # torch optimizers re-create per-parameter state on their next step
        ts = torch.load(path / "trainer_state.pt", weights_only=False)
        self.steps_done = ts["steps_done"]
        torch.set_rng_state(ts["rng"])
        torch.cuda.set_rng_state(ts["cuda_rng"])


class _HFStyleForward:
    """``trainer.model(input_ids=ids).logits``: full-vocabulary float32 logits ``[b, s, vocab]`` on CPU (TP-gathered)
    — the view the contract kit and tests compare against Hugging Face."""

    def __init__(self, trainer: MegatronTrainer) -> None:
        self.trainer = trainer

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        import torch.distributed as dist

        t = self.trainer
        ids = input_ids.cuda()
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        logits = t._vocab_parallel_logits(ids, pos)
        if t.tp > 1:
            parts = [torch.empty_like(logits) for _ in range(t.tp)]
            dist.all_gather(parts, logits.contiguous(), group=t.tp_group)
            logits = torch.cat(parts, dim=-1)
        return SimpleNamespace(logits=logits[..., : t.arch.vocab_size].cpu())
