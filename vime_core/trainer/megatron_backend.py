"""``megatron`` trainer backend: a megatron-core ``GPTModel`` (bf16, ``Float16Module``, Megatron DDP and distributed
optimizer) trained with the same RL step as the torch backend (:func:`vime_core.trainer.rl_step.rl_train_step`).

:class:`MegatronTrainer` needs a CUDA GPU and ``megatron-core``; it initialises ``torch.distributed`` itself, maps HF
weights with :mod:`vime_core.trainer.megatron_convert`, and runs tensor and data parallelism (with
:mod:`vime_core.trainer.megatron_critic` for ``ppo`` and :mod:`vime_core.trainer.megatron_lora` for LoRA). Layer
specs, parallelism and limits: docs/gpu.md, "The megatron backend".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from vime_core.algorithms.options import check_algorithm_config, kl_enabled, uses_critic
from vime_core.config import RunConfig
from vime_core.trainer.base import TrainerBackend, lora_adapter_of
from vime_core.trainer.determinism import enable_trainer_determinism
from vime_core.trainer.fp32_head import install_fp32_output_layer
from vime_core.trainer.lr_schedule import policy_lr_schedule, set_lr
from vime_core.trainer.megatron_convert import (
    ArchConfig,
    hf_to_megatron,
    megatron_to_hf,
    pad_vocab,
    shard,
    unpad_vocab,
)
from vime_core.trainer.megatron_critic import MegatronCritic
from vime_core.trainer.megatron_experts import (
    check_expert_parallel,
    check_routing_replay,
    expert_bias_buffers,
    float16_module,
    gather_experts,
)
from vime_core.trainer.megatron_lora import MegatronAdapterReference, MegatronLora
from vime_core.trainer.megatron_model import (
    SDPACoreAttention,
    gpt_model_fields,
    have_transformer_engine,
    init_distributed,
    install_rope,
    layer_spec,
    tp_full,
    transformer_config_fields,
)
from vime_core.trainer.megatron_moe import ep_shard, expert_of
from vime_core.trainer.megatron_moe_model import moe_config_fields, set_replay_routes, transformer_config_class
from vime_core.trainer.megatron_optim import inner_optimizers, load_optimizer, megatron_step, save_optimizer
from vime_core.trainer.megatron_packing import packed_seq_params, thd_batch
from vime_core.trainer.megatron_reference import MegatronReferenceModel, vocab_parallel_entropy
from vime_core.trainer.rl_step import rl_train_step
from vime_core.trainer.rng_state import load_trainer_state, save_trainer_state
from vime_core.trainer.routing_replay import megatron_routes
from vime_core.types import RolloutBatch, Sample
from vime_core.weight_sync.tensor_io import safetensors_files

# the backend's public names, importable from here as before the split into megatron_{model,optim,reference}.py
__all__ = [
    "MegatronReferenceModel",
    "MegatronTrainer",
    "SDPACoreAttention",
    "have_transformer_engine",
    "init_distributed",
    "inner_optimizers",
    "layer_spec",
    "load_optimizer",
    "megatron_step",
    "save_optimizer",
    "vocab_parallel_entropy",
]

logger = logging.getLogger("vime.trainer")


def swiglu_fusion_works() -> bool:
    """Whether megatron-core's fused SwiGLU (``bias_activation_fusion``: ``torch.compile`` of ``silu(a) * b``)
    compiles and runs here, tried once on a small CUDA tensor; ``False`` (logged) sends the trainer back to the
    unfused ops."""
    try:
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

        x = torch.randn(4, 2, 16, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        bias_swiglu_impl(x, None).sum().backward()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - any failure means: do not fuse
        logger.warning("--bias-swiglu-fusion: megatron-core's fused SwiGLU does not run here (%r); unfused", e)
        return False
    return True


class MegatronTrainer(TrainerBackend):
    """megatron-core GPTModel + Megatron's distributed optimizer; one optimizer step per ``--global-batch-size``
    samples (default: the whole rollout), gradient accumulation over ``--micro-batch-size`` micro-batches.

    Flags: the trainer's and the algorithm's (``trainer_config``, ``algorithm_config``: ``--seed``, ``--lr``, Adam,
    ``--weight-decay``, ``--clip-grad``, batch sizes, loss options) and Megatron's own (``megatron_config``, a
    :class:`~vime_core.config.MegatronConfig`: ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
    ``--context-parallel-size``, ``--sequence-parallel``, ``--recompute-*``, ``--use-distributed-optimizer``,
    ``--megatron-attention``, default te if TE imports, else sdpa; ``--bias-swiglu-fusion``
    (:func:`swiglu_fusion_works`); ``--qkv-format`` (thd: packed micro-batches,
    :mod:`vime_core.trainer.megatron_packing`); ``--deterministic-mode``
    (:func:`~vime_core.trainer.determinism.enable_trainer_determinism`)) and ``--fp32-lm-head`` (float32 logits,
    :mod:`vime_core.trainer.fp32_head`).

    :raises RuntimeError: without CUDA. :raises NotImplementedError: for pipeline or context parallelism.
    :raises vime_core.trainer.megatron_convert.ConversionError: if the checkpoint is not a supported architecture.
    """

    NAME = "megatron"
    SUPPORTS_LORA = True
    DISTRIBUTED = True  # one rank per GPU: TP × PP × CP × DP from torchrun's environment (init_distributed)

    def __init__(self, config: RunConfig, model_path: Path) -> None:
        super().__init__(config, model_path)
        from megatron.core import parallel_state as mpu
        from megatron.core import tensor_parallel
        from megatron.core.models.gpt import GPTModel
        from transformers import AutoConfig

        mcfg = self.megatron_config = config.megatron
        # before any GPU/distributed setup, so a bad flag is reported at once
        check_algorithm_config(self.algorithm_config)
        if mcfg.deterministic_mode:  # before the first cuBLAS handle
            enable_trainer_determinism()
        self.rank, self.world, _ = init_distributed()
        self.tp = int(mcfg.tensor_model_parallel_size or 1)
        pp = int(mcfg.pipeline_model_parallel_size or 1)
        cp = int(mcfg.context_parallel_size or 1)
        if pp != 1 or cp != 1:
            raise NotImplementedError(
                f"the megatron backend supports tensor and data parallelism only (got pipeline {pp}, context {cp})"
            )
        if mcfg.sequence_parallel and self.tp > 1 and not have_transformer_engine():
            raise ValueError(
                "--sequence-parallel needs Transformer Engine: megatron-core's torch norms (local spec) "
                "do not support sequence parallelism"
            )
        self.hf_config = AutoConfig.from_pretrained(str(model_path))
        self.arch = ArchConfig.from_hf(self.hf_config)
        self.ep = check_expert_parallel(self.arch, int(mcfg.expert_model_parallel_size or 1), self.tp, self.world)
        self.routing_replay = bool(self.algorithm_config.use_rollout_routing_replay)
        check_routing_replay(self.arch, self.routing_replay)
        if not mpu.model_parallel_is_initialized():
            mpu.initialize_model_parallel(tensor_model_parallel_size=self.tp, expert_model_parallel_size=self.ep)
        self.tp_rank = mpu.get_tensor_model_parallel_rank()
        self.tp_group = mpu.get_tensor_model_parallel_group()
        self.ep_rank = mpu.get_expert_model_parallel_rank() if self.ep > 1 else 0
        self.ep_group = mpu.get_expert_model_parallel_group() if self.ep > 1 else None
        moe = self.arch.moe is not None  # experts split over the expert-TP group (its size is the TP size)
        self.etp_rank = mpu.get_expert_tensor_parallel_rank() if moe else self.tp_rank
        self.etp_group = mpu.get_expert_tensor_parallel_group() if moe else self.tp_group
        self.dp_rank = mpu.get_data_parallel_rank()
        self.dp_size = mpu.get_data_parallel_world_size()
        self.dp_group = mpu.get_data_parallel_group()
        tensor_parallel.model_parallel_cuda_manual_seed(int(self.trainer_config.seed))
        torch.manual_seed(int(self.trainer_config.seed))

        self.te = have_transformer_engine()
        self.attention = mcfg.megatron_attention or ("te" if self.te else "sdpa")
        if mcfg.qkv_format == "thd" and self.attention == "local":
            raise ValueError(
                "--qkv-format thd (packed micro-batches) needs --megatron-attention sdpa or te: Megatron's unfused "
                "local attention takes no packed sequences"
            )
        self.padded_vocab = math.ceil(self.arch.vocab_size / self.tp) * self.tp
        moe_fields = moe_config_fields(
            self.arch, aux_loss_coeff=float(mcfg.moe_aux_loss_coeff or 0.0), routing_replay=self.routing_replay
        )
        self.config = transformer_config_class(self.arch)(
            **{**transformer_config_fields(self.arch), **moe_fields},
            expert_model_parallel_size=self.ep,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            bf16=True,
            params_dtype=torch.bfloat16,
            pipeline_dtype=torch.bfloat16,
            tensor_model_parallel_size=self.tp,
            sequence_parallel=bool(mcfg.sequence_parallel) and self.tp > 1,
            recompute_granularity=mcfg.recompute_granularity,
            recompute_method=mcfg.recompute_method,
            recompute_num_layers=mcfg.recompute_num_layers,
            masked_softmax_fusion=False,
            bias_activation_fusion=bool(mcfg.bias_swiglu_fusion) and swiglu_fusion_works(),
            apply_rope_fusion=False,
            persist_layer_norm=False,
            gradient_accumulation_fusion=False,
            deterministic_mode=bool(mcfg.deterministic_mode),
        )
        self._GPTModel = GPTModel
        gpt = self.new_gpt()
        if mcfg.fp32_lm_head:
            install_fp32_output_layer(gpt, self.tp, self.tp_group)
        self.gpt = gpt
        self.load_hf_weights(model_path)
        lora_cfg = config.lora
        self.lora = MegatronLora(self, lora_cfg) if lora_cfg.enabled else None  # before Float16Module and DDP
        self.module = float16_module(self.config, gpt)  # correction biases kept in fp32
        self.ddp, self.optimizer = self.wrap_for_training(self.module, policy_lr_schedule(self.trainer_config).max_lr)
        self.steps_done = 0
        self.model = _HFStyleForward(self)  # the contract kit's view: model(input_ids=...).logits
        self.ref_model: MegatronReferenceModel | MegatronAdapterReference | None = None
        if kl_enabled(self.algorithm_config):
            no_copy = self.lora is not None and self.algorithm_config.ref_load is None
            self.ref_model = MegatronAdapterReference(self) if no_copy else MegatronReferenceModel(self)
        self.critic = None
        if uses_critic(self.algorithm_config):
            self.critic = MegatronCritic(self)

    # -- model construction (shared with the reference model and the critic) -----------------------------------------
    def new_gpt(self, *, tied: bool | None = None) -> Any:
        """A new ``GPTModel`` of this architecture on the current GPU (random weights).

        :param tied: share the embedding and output weights (default: as the HF config says).
        """
        a = self.arch
        gpt = self._GPTModel(
            config=self.config,
            transformer_layer_spec=layer_spec(self.attention, self.te, a, self.config),
            vocab_size=self.padded_vocab,
            pre_process=True,
            post_process=True,
            parallel_output=True,
            share_embeddings_and_output_weights=a.tie_word_embeddings if tied is None else tied,
            **gpt_model_fields(a),
        )
        install_rope(gpt, a)  # RoPE scaling (Llama 3.1+): transformers' inverse frequencies
        return gpt.cuda(torch.cuda.current_device())

    def wrap_for_training(self, module: Any, lr: float) -> tuple[Any, Any]:
        """Megatron DDP (fp32 gradient reduction) and Megatron's (distributed) Adam for a ``Float16Module``.

        :param lr: the peak learning rate (Megatron's ``OptimizerConfig.lr``); the learning rate of each optimizer
            step is set before it from the shared schedule (:mod:`vime_core.trainer.lr_schedule`, Megatron's
            formulas) by :func:`~vime_core.trainer.rl_step.rl_train_step` and the critic.
        :return: ``(ddp, optimizer)``.
        """
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.trainer_config
        use_dist_opt = bool(self.megatron_config.use_distributed_optimizer)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=use_dist_opt
        )
        ddp = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=module)
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=use_dist_opt,
        )
        optimizer = get_megatron_optimizer(opt_config, [ddp])
        set_lr(optimizer, lr)
        return ddp, optimizer

    # -- weights -----------------------------------------------------------------------------------------------------
    def read_hf(self, path: Path) -> dict[str, torch.Tensor]:
        """Every tensor of an HF checkpoint directory's ``*.safetensors`` files, ``{HF name: CPU tensor}``."""
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor] = {}
        for f in safetensors_files(path):
            out.update(load_file(str(f)))
        return out

    @torch.no_grad()
    def load_hf_tensors(
        self, hf: dict[str, torch.Tensor], gpt: Any = None, arch: ArchConfig | None = None, skip: tuple = ()
    ) -> None:
        """Copy HF tensors (cast to bf16) into this rank's Megatron parameters (shards of them under TP).

        :param gpt: the model to fill (default: the policy).
        :param arch: the architecture to map with (default: the policy's).
        :param skip: Megatron parameter names left alone (e.g. a critic's value head).
        :raises ConversionError: on a missing/unexpected/mis-shaped tensor.
        :raises KeyError: if the mapping produces a name the model does not have (or misses one it has).
        """
        gpt = self.gpt if gpt is None else gpt
        arch = arch or self.arch
        mc = pad_vocab(hf_to_megatron(hf, arch, te=self.attention == "te"), self.padded_vocab)
        if self.ep > 1:  # this EP rank's experts, under their local indices
            mc = ep_shard(mc, self.ep_rank, self.ep, arch.moe.num_experts)
        params = {n: p for n, p in gpt.named_parameters() if n not in skip}
        params.update(expert_bias_buffers(gpt))  # MoE correction biases are buffers, loaded like parameters
        missing, unexpected = sorted(set(params) - set(mc)), sorted(set(mc) - set(params))
        if missing or unexpected:
            raise KeyError(
                f"HF→Megatron mapping does not fit the model: missing {missing[:6]}, unexpected {unexpected[:6]}"
            )
        for name, p in params.items():
            expert = expert_of(name) is not None
            part = shard(name, mc[name], self.etp_rank if expert else self.tp_rank, self.tp)
            if part.shape != p.shape:
                raise KeyError(f"{name}: mapped shard {tuple(part.shape)} vs parameter {tuple(p.shape)}")
            p.copy_(part.to(device=p.device, dtype=p.dtype))

    def load_hf_weights(self, path: Path) -> None:
        """Load an HF checkpoint directory into the model (call :meth:`reload_optimizer_params` afterwards once the
        optimizer exists)."""
        self.load_hf_tensors(self.read_hf(Path(path)))

    @torch.no_grad()
    def megatron_tensors(self, gpt: Any = None, skip: tuple = ()) -> dict[str, torch.Tensor]:
        """Full (TP-gathered, unpadded) Megatron tensors on this rank's GPU (of ``gpt``, default the policy; names in
        ``skip`` left out). Collective under TP."""
        out = {}
        gpt = self.gpt if gpt is None else gpt
        named = [*gpt.named_parameters(), *expert_bias_buffers(gpt).items()]
        for name, p in named:
            if name not in skip:
                group = self.etp_group if expert_of(name) is not None else self.tp_group
                out[name] = tp_full(p, name, self.tp, group)
        if self.ep > 1:  # every EP rank's experts, under their global indices
            out = gather_experts(out, self.ep, self.ep_group)
        return unpad_vocab(out, self.arch.vocab_size)

    def named_hf_tensors(self, device: str | None = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
        """HF names and bf16 tensors (contiguous) on ``device`` (``None``: on this rank's GPU, no host copy — what
        ``ipc``/``nccl`` weight sync take); a tied ``lm_head.weight`` is left out, as in the torch backend. Every TP
        rank must iterate (the gather is collective)."""
        if self.lora is not None:  # the merged weights
            mc = unpad_vocab(self.lora.merged(self.lora.full_tensors()), self.arch.vocab_size)
        else:
            mc = self.megatron_tensors()
        for name, t in megatron_to_hf(mc, self.arch, te=self.attention == "te").items():
            t = t.contiguous()
            yield name, t if device is None else t.to(device)

    # -- forward -----------------------------------------------------------------------------------------------------
    def token_batch(self, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ``[b, s]`` int64 token ids of ``samples`` (padded with 0 to the longest; to a multiple of the
        TP size under sequence parallelism) and their ``[b, s]`` positions, on the current GPU."""
        max_len = max(len(s.tokens) for s in samples)
        if self.config.sequence_parallel:
            max_len = math.ceil(max_len / self.tp) * self.tp
        ids = torch.zeros((len(samples), max_len), dtype=torch.long)
        for i, s in enumerate(samples):
            ids[i, : len(s.tokens)] = torch.tensor(s.tokens, dtype=torch.long)
        ids = ids.cuda(non_blocking=True)
        pos = torch.arange(max_len, device=ids.device).unsqueeze(0).expand_as(ids)
        if self.routing_replay:  # the batch's recorded experts, in every model that will run it
            self.replay(samples, max_len)
        return ids, pos

    def replay(self, samples: list[Sample], seq_len: int) -> None:
        """``--use-rollout-routing-replay``: every router of the policy and of the KL reference model routes the
        tokens of ``samples`` (a right-padded ``[batch, seq_len]`` batch) to their recorded experts
        (:func:`~vime_core.trainer.routing_replay.megatron_routes`, megatron-core's ``RouterReplay``).

        :raises ValueError: naming a sample whose ``routed_experts`` are missing or do not fit the model.
        """
        moe = self.arch.moe
        sp = self.config.sequence_parallel
        routes = megatron_routes(
            samples, seq_len, self.arch.num_layers, moe.top_k, moe.num_experts, self.tp_rank, self.tp if sp else 1
        )
        for module in (self.gpt, getattr(self.ref_model, "module", None)):
            if module is not None:
                set_replay_routes(module, routes)

    def _vocab_parallel_logits(self, ids: torch.Tensor, pos: torch.Tensor, module: Any = None) -> torch.Tensor:
        """``[b, s, padded_vocab / tp]`` float32 logits of ``module`` (default: the policy) with padded vocabulary
        columns at ``-inf``."""
        return self._mask_vocab_padding((self.ddp if module is None else module)(ids, pos, None).float())

    def _mask_vocab_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (``[..., padded_vocab / tp]``, this rank's shard) with the padded vocabulary columns set to
        ``-inf`` in place."""
        per = self.padded_vocab // self.tp
        first_pad = self.arch.vocab_size - self.tp_rank * per
        if first_pad < per:
            logits[..., max(first_pad, 0) :] = float("-inf")
        return logits

    def _entropy(self, logits: torch.Tensor) -> torch.Tensor:
        """Next-token entropies of vocab-parallel float32 ``logits``: with a graph only when ``--entropy-coef`` is
        non-zero and grad is on (otherwise a metric: no graph, less memory)."""
        group = self.tp_group if self.tp > 1 else None
        if torch.is_grad_enabled() and self.algorithm_config.entropy_coef:
            return vocab_parallel_entropy(logits, group)  # saves only tensors it creates
        with torch.no_grad():
            return vocab_parallel_entropy(logits, group)

    def token_log_probs(
        self, ids: torch.Tensor, pos: torch.Tensor, module: Any = None, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[b, s - 1]`` float32 log-probs of each next token (vocab-parallel cross entropy; differentiable) and,
        with ``with_entropy``, the ``[b, s - 1]`` entropies of the next-token distributions (nats; differentiable
        only when ``--entropy-coef`` is non-zero, otherwise computed without a graph to save memory)."""
        from megatron.core import tensor_parallel

        logits = self._vocab_parallel_logits(ids, pos, module)[:, :-1].contiguous()
        # the entropy before the cross entropy, which overwrites ``logits`` in place (with the softmax)
        ent = self._entropy(logits) if with_entropy else None
        lp = -tensor_parallel.vocab_parallel_cross_entropy(logits, ids[:, 1:].contiguous())
        return lp, ent

    def response_slices(self, samples: list[Sample], x: torch.Tensor) -> list[torch.Tensor]:
        """Per sample the ``[response_length]`` slice of a ``[b, s - 1]`` next-token tensor (right-padded batch)."""
        return [x[i, s.prompt_length - 1 : s.prompt_length - 1 + s.response_length] for i, s in enumerate(samples)]

    def sample_log_probs(
        self, samples: list[Sample], module: Any = None, with_entropy: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per sample ``[response_length]`` float32 log-probs of the response tokens under ``module`` (default: the
        policy; differentiable when grad is on) and, with ``with_entropy``, the next-token entropies
        (:meth:`token_log_probs`). ``--qkv-format bshd``: one right-padded batch; ``thd``: one packed row
        (:func:`~vime_core.trainer.megatron_packing.thd_batch`), the log-softmax on the response positions only."""
        if self.megatron_config.qkv_format != "thd":
            ids, pos = self.token_batch(samples)
            lp, ent = self.token_log_probs(ids, pos, module=module, with_entropy=with_entropy)
            return self.response_slices(samples, lp), None if ent is None else self.response_slices(samples, ent)
        from megatron.core import tensor_parallel

        b = thd_batch(samples, self.tp if self.config.sequence_parallel else 1, self.loss_device)
        model = self.ddp if module is None else module
        logits = model(b.input_ids, b.position_ids, None, packed_seq_params=packed_seq_params(b)).float()
        logits = self._mask_vocab_padding(logits[0].index_select(0, b.predict_index)).unsqueeze(0)  # [1, M, V/tp]
        ent = self._entropy(logits) if with_entropy else None  # before the cross entropy overwrites the logits
        lp = -tensor_parallel.vocab_parallel_cross_entropy(logits, b.targets.unsqueeze(0))
        return b.split(lp[0]), None if ent is None else b.split(ent[0])

    # -- what the shared RL step needs (vime_core.trainer.rl_step.PolicyOps) ----------------------------------------
    @property
    def loss_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def policy_log_probs(
        self, samples: list[Sample], with_entropy: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per sample ``[response_length]`` float32 log-probs (and entropies) of the response, graph attached
        (:meth:`sample_log_probs`)."""
        return self.sample_log_probs(samples, with_entropy=with_entropy)

    def dp_all_gather(self, obj: Any) -> list[Any]:
        """Every data-parallel rank's ``obj`` (picklable), in DP-rank order (``all_gather_object`` on Megatron's
        data-parallel group)."""
        import torch.distributed as dist

        if self.dp_size == 1:
            return [obj]
        out: list[Any] = [None] * self.dp_size
        dist.all_gather_object(out, obj, group=self.dp_group)
        return out

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> float:
        """Finalize gradients (DP reduce-scatter, SP layernorm grads across TP), clip and step.

        :raises FloatingPointError: on a non-finite gradient norm.
        """
        return megatron_step(self.ddp, self.optimizer, f"grad norm at train step {self.steps_done}:")

    # -- training ----------------------------------------------------------------------------------------------------
    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """One RL step on ``batch``: :func:`vime_core.trainer.rl_step.rl_train_step`, the same code as the torch
        backend (its docstring lists the order, the metrics and the errors)."""
        return rl_train_step(self, batch)

    # -- LoRA --------------------------------------------------------------------------------------------------------
    def lora_adapter(self) -> tuple[dict[str, torch.Tensor], dict]:
        """LoRA: PEFT's HF-named adapter tensors (CPU, fp32) and ``adapter_config.json``
        (:func:`~vime_core.trainer.base.lora_adapter_of`). Collective under TP.

        :raises RuntimeError: without ``--lora-rank``.
        """
        return lora_adapter_of(self.lora)

    def save_adapter(self, path: Path) -> None:
        """LoRA: the PEFT adapter directory (rank 0 writes; collective under TP)."""
        import json

        from safetensors.torch import save_file

        tensors, config = self.lora_adapter()
        if self.rank != 0:
            return
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        (path / "adapter_config.json").write_text(json.dumps(config, indent=1))

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
        ``optimizer_param_state.pt``; none before the first optimizer step) + ``trainer_state.pt``; with ``ppo`` the
        critic under ``critic/`` (:meth:`~vime_core.trainer.megatron_critic.MegatronCritic.save`). Collective: every
        rank calls it."""
        import torch.distributed as dist

        path = Path(path)
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        if self.lora is not None:  # the adapter alone (PEFT's layout): the base weights never change
            self.save_adapter(path / "adapter")
        tensors = dict(self.named_hf_tensors()) if self.lora is None else {}
        if self.rank == 0:
            from safetensors.torch import save_file

            if self.lora is None:
                save_file(tensors, str(path / "model.safetensors"))
            save_trainer_state(path, self)  # the RNG state: Python, numpy, torch and this rank's CUDA device
        if self.steps_done:
            save_optimizer(self.optimizer, path, self.rank)
        if self.critic is not None:
            self.critic.save(path / "critic")
        dist.barrier()

    def load_checkpoint(self, path: Path) -> None:
        """Restore what :meth:`save_checkpoint` wrote (weights, optimizer state, RNG, and the critic with ``ppo``);
        a checkpoint from before the first optimizer step restores a fresh optimizer.

        :raises FileNotFoundError: if a file is missing (the critic's included).
        """
        from safetensors.torch import load_file

        path = Path(path)
        if self.lora is not None:
            self.lora.load_peft_state(load_file(str(path / "adapter" / "adapter_model.safetensors")))
        else:
            self.load_hf_tensors(load_file(str(path / "model.safetensors")))
        load_optimizer(self.optimizer, path)
        if self.critic is not None:
            self.critic.load(path / "critic")
        load_trainer_state(path, self)


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
