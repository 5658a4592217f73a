"""``torch`` trainer backend: a Hugging Face causal LM trained with a torch optimizer (fp32 on CPU by default).

Every algorithm is shared code (:mod:`vime_core.algorithms`); this backend only supplies log-probs and entropies:
:func:`~vime_core.algorithms.batch.postprocess_advantages` (KL shaping, batch whitening),
:func:`~vime_core.algorithms.policy_loss.policy_loss` (PPO/GSPO surrogate, dual clip, TIS/MIS, entropy, KL loss)
and :func:`~vime_core.algorithms.mismatch.check_logprob_drift` (the drift budget). With ``--advantage-estimator
ppo`` a :class:`~vime_core.trainer.critic.Critic` (value head on a copy of the policy) is trained alongside:
:func:`~vime_core.algorithms.batch.gae_advantages` and :func:`~vime_core.algorithms.gae.value_loss`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from vime_core.algorithms.logprobs import selected_log_probs_and_entropy
from vime_core.algorithms.options import check_algorithm_config, kl_enabled, uses_critic
from vime_core.config import RunConfig
from vime_core.models import resolve_model
from vime_core.trainer.base import TrainerBackend, lora_adapter_of
from vime_core.trainer.critic import Critic, adamw_with_checkpointing, clip_and_step
from vime_core.trainer.fp32_head import install_fp32_lm_head
from vime_core.trainer.lora_torch import AdapterDisabledReference, LoraModel
from vime_core.trainer.packing import enable_packed_attention, packed_batch, packed_hidden_states
from vime_core.trainer.padding import left_padded_batch, response_slices
from vime_core.trainer.rl_step import rl_train_step
from vime_core.trainer.rng_state import load_trainer_state, save_trainer_state
from vime_core.trainer.routing_replay import RoutingReplay, packed_routes, padded_routes
from vime_core.trainer.vision import (
    check_vl_run,
    checkpoint_names,
    freeze_vision_tower,
    is_vl_model,
    load_hf_model,
    named_checkpoint_tensors,
    vl_response_log_probs,
)
from vime_core.types import RolloutBatch, Sample

logger = logging.getLogger("vime.trainer")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def response_log_probs(
    model: torch.nn.Module,
    samples: list[Sample],
    device: torch.device,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    packing: bool = True,
    routing_replay: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """One batched forward pass of ``samples``; the log-probs (and entropies) of each sample's response tokens.

    ``packing=True`` (the default): the samples are packed into one row without padding
    (:mod:`vime_core.trainer.packing`; ``model`` is switched to its per-sample attention by
    :func:`~vime_core.trainer.packing.enable_packed_attention`), and the LM head runs only on the hidden states that
    predict a response token: ``[sum(response_length), vocab]`` logits, no prompt position's. ``packing=False``: the
    left-padded batch (:mod:`vime_core.trainer.padding`, explicit ``position_ids``; the LM head on the last
    ``max(response_length) + 1`` positions of every row, ``logits_to_keep``), the reference the packed path is
    tested against (equal within float32 rounding).

    :param model: an HF causal LM (policy or reference) whose logits are ``lm_head(final hidden state)`` (no logit
        scaling or soft-capping: checked).
    :param samples: the samples (``tokens`` = prompt + response; a prompt of at least one token).
    :param device: where ``model`` lives.
    :param with_entropy: also return each response token's next-token entropy (nats).
    :param entropy_grad: the entropies keep their graph (only an entropy term in the loss needs it); False computes
        them under ``no_grad`` (same values; no ``[tokens, vocab]`` tensors kept for the backward pass).
    :param packing: packed rows (default) or the left-padded batch.
    :param routing_replay: ``--use-rollout-routing-replay``: every MoE router routes each token to the experts of the
        sample's ``routed_experts`` (:mod:`vime_core.trainer.routing_replay`).
    :return: ``(log_probs, entropies)``: one ``[response_length]`` float32 tensor per sample each (graph attached
        when grad is enabled; on ``device``); ``entropies`` is None unless ``with_entropy``.
    :raises ValueError: with ``packing``, if the model scales or soft-caps its logits; with ``routing_replay``, naming
        the sample whose ``routed_experts`` are missing or do not fit the model.

    A vision-language model takes its own path (its images and multimodal RoPE positions, left-padded:
    :func:`vime_core.trainer.vision.vl_response_log_probs`) whatever ``packing`` says (no routing replay: a VLM run
    refuses ``--use-rollout-routing-replay``, :func:`vime_core.trainer.vision.check_vl_run`).
    """
    if is_vl_model(model):
        return vl_response_log_probs(model, samples, device, with_entropy, entropy_grad)
    if not packing:
        batch = left_padded_batch(samples, device)
        if routing_replay:
            replay = RoutingReplay.of(model)
            replay.set_routes(padded_routes(samples, batch.seq_len, replay))
        keep = batch.keep
        logits = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            logits_to_keep=keep,
        ).logits
        tail = batch.input_ids[:, batch.seq_len - keep :]  # the tokens at the last keep positions
        rows = logits[:, :-1].reshape(-1, logits.shape[-1])  # [B * (keep - 1), vocab]: position t predicts t + 1
        lp, ent = selected_log_probs_and_entropy(rows, tail[:, 1:].reshape(-1), with_entropy, entropy_grad)
        lp = lp.view(len(samples), keep - 1)
        return response_slices(lp, samples), None if ent is None else response_slices(ent.view_as(lp), samples)
    check_plain_lm_head(model)
    packed = packed_batch(samples, device)
    if routing_replay:
        replay = RoutingReplay.of(model)
        replay.set_routes(packed_routes(samples, replay))
    enable_packed_attention(model)  # packed_hidden_states raises if the model could not switch
    hidden = packed_hidden_states(model.base_model, packed)  # [total, hidden]
    logits = model.get_output_embeddings()(hidden.index_select(0, packed.predict_index))  # [M, vocab]
    lp, ent = selected_log_probs_and_entropy(logits, packed.targets, with_entropy, entropy_grad)
    return packed.split(lp), None if ent is None else packed.split(ent)


# config attributes of HF models whose logits are not plain ``lm_head(hidden)`` (Gemma 2/3, Cohere, Granite)
SCALED_LOGITS_ATTRS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _scaled_logits_attr(model: torch.nn.Module) -> str | None:
    """``"attr=value"`` of the first :data:`SCALED_LOGITS_ATTRS` entry that makes ``model``'s logits other than
    ``lm_head(hidden)``, else None."""
    for attr in SCALED_LOGITS_ATTRS:
        value = getattr(model.config, attr, None)
        if value is not None and value != 1.0:
            return f"{attr}={value}"
    return None


def check_plain_lm_head(model: torch.nn.Module) -> None:
    """:func:`response_log_probs` applies ``model.get_output_embeddings()`` itself (to the response positions only).

    :raises ValueError: naming the attribute if ``model.config`` scales or soft-caps the logits.
    """
    scaled = _scaled_logits_attr(model)
    if scaled is not None:
        raise ValueError(f"the torch backend computes logits as lm_head(hidden); {scaled} is not supported")


def packable(model: torch.nn.Module) -> bool:
    """Whether ``model``'s log-probs can take the packed path of :func:`response_log_probs`: its attention switched
    to the packed one (:func:`~vime_core.trainer.packing.enable_packed_attention`, done here) and its logits plain
    ``lm_head(hidden)``. Else the policy and reference model use left-padded batches (the model's own forward).
    A vision-language model is never packed (its attention stays as loaded: the vision tower's too)."""
    if is_vl_model(model):
        return False
    return enable_packed_attention(model) and _scaled_logits_attr(model) is None


class ReferenceModel:
    """The frozen reference policy for KL (``--ref-load``: an HF directory or a known model name; default: the
    initial policy), on the trainer's device and dtype, with float32 logits when ``fp32_lm_head`` (as the policy's).
    Loaded only when KL is enabled.
    """

    def __init__(
        self,
        ref_load: str | None,
        model_path: Path,
        device: torch.device,
        dtype: torch.dtype,
        routing_replay: bool = False,
        fp32_lm_head: bool = False,
    ) -> None:
        path = Path(ref_load or model_path)
        if not (path / "config.json").is_file():
            path = resolve_model(str(ref_load))
        self.path = path
        self.device = device
        self.model = load_hf_model(path, dtype).to(device)
        if fp32_lm_head:  # the policy's logits are float32 too (TorchTrainer)
            install_fp32_lm_head(self.model)
        self.model.eval()
        self.model.requires_grad_(False)
        self.packing = packable(self.model)  # packed rows (see response_log_probs), else left-padded batches
        self.routing_replay = routing_replay  # --use-rollout-routing-replay: the engine's experts, as the policy's

    @torch.no_grad()
    def log_probs(self, samples: list[Sample], micro_batch_size: int) -> dict[int, torch.Tensor]:
        """Reference log-probs of every sample's response, keyed by ``id(sample)`` (float32, CPU, no grad)."""
        out: dict[int, torch.Tensor] = {}
        for i in range(0, len(samples), micro_batch_size):
            mb = samples[i : i + micro_batch_size]
            lps = response_log_probs(
                self.model, mb, self.device, packing=self.packing, routing_replay=self.routing_replay
            )[0]
            for s, lp in zip(mb, lps, strict=True):
                out[id(s)] = lp.float().cpu()
        return out


def checkpoint_layout(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the model's ``state_dict``) under the names and shapes its checkpoint has: transformers 5 fuses some
    weights in memory (an MoE layer's experts into ``gate_up_proj`` / ``down_proj``) and ``save_pretrained`` splits
    them back with ``revert_weight_conversion``; the same here. Unchanged for models without such conversions."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: the in-memory layout is the checkpoint's
        return dict(state)
    return revert_weight_conversion(model, dict(state))


class TorchTrainer(TrainerBackend):
    """HF model + AdamW; gradient accumulation over micro-batches, each packed into one row without padding
    (:mod:`vime_core.trainer.packing`; :meth:`use_packing` selects left-padded batches instead).

    One optimizer step per mini-batch of ``--global-batch-size`` samples (default: the whole rollout, i.e. one
    step per rollout, where the old policy equals the current one and the PPO ratio is exactly 1). With more than
    one mini-batch, or with KL reward shaping, the old-policy log-probs are computed before the first update. With
    KL enabled (``--use-kl-loss`` or ``--kl-coef``) a frozen :class:`ReferenceModel` supplies reference log-probs.
    With ``--advantage-estimator ppo`` a :class:`~vime_core.trainer.critic.Critic` takes one optimizer step per
    mini-batch next to the policy's (only the critic's during the first ``--num-critic-only-steps`` steps).

    With ``--lora-rank`` > 0 the model gets a PEFT LoRA adapter (:class:`~vime_core.trainer.lora_torch.LoraModel`):
    only its parameters are optimized, the KL reference is the base model with the adapter disabled
    (:class:`~vime_core.trainer.lora_torch.AdapterDisabledReference`, unless ``--ref-load`` names another model),
    checkpoints hold the adapter instead of the weights, :meth:`save_hf` writes the merged model and
    :meth:`save_adapter` the adapter. The critic is unchanged (full fine-tuning of its own copy).
    """

    NAME = "torch"
    SUPPORTS_LORA = True

    def __init__(self, config: RunConfig, model_path: Path) -> None:
        super().__init__(config, model_path)
        cfg, algo = self.trainer_config, self.algorithm_config
        check_algorithm_config(algo)

        torch.manual_seed(cfg.seed)
        # Ray starts actors with OMP_NUM_THREADS=1 (num_cpus=0 actors), which halves CPU training speed on 2 cores:
        # use every core this process may run on unless --train-num-threads says otherwise.
        torch.set_num_threads(cfg.train_num_threads or len(os.sched_getaffinity(0)))
        self.device = torch.device(cfg.train_device)
        dtype = DTYPES[cfg.train_dtype]
        self.model = load_hf_model(model_path, dtype).to(self.device)
        # --fp32-lm-head: float32 logits from a bf16/fp16 model, as the engine returns them (no change in float32)
        self.fp32_lm_head = cfg.fp32_lm_head and install_fp32_lm_head(self.model)
        # a vision-language model: its vision tower trains unless --freeze-vision-tower (docs/vlm.md)
        self.vision_frozen = False
        self.vision_model = is_vl_model(self.model)
        if self.vision_model:
            check_vl_run(config)
            if cfg.freeze_vision_tower:
                freeze_vision_tower(self.model)
                self.vision_frozen = True
        lora_cfg = config.lora
        self.lora = LoraModel(self.model, lora_cfg) if lora_cfg.enabled else None
        if self.lora is not None:
            self.model = self.lora.model  # the HF model, its layers now with the adapter
        # R3: every forward pass of the policy and the reference model replays the engine's routes
        self.routing_replay = bool(algo.use_rollout_routing_replay)
        if self.routing_replay:
            RoutingReplay.of(self.model)  # a model without replayable routers fails here, before any step
        self.packing = packable(self.model)
        if not self.packing and not self.vision_model:  # a VLM's micro-batches are left-padded by design
            logger.warning(
                "%s cannot switch its attention implementation or scales its logits: left-padded micro-batches",
                model_path,
            )
        self.model.train()
        frozen_embeddings = self.lora is not None  # checkpointed blocks then need an input that requires grad
        self.optimizer = adamw_with_checkpointing(
            self.model, self.trainable_parameters(), cfg, cfg.lr, self.device, input_require_grads=frozen_embeddings
        )
        self.ref_model: ReferenceModel | AdapterDisabledReference | None = None
        if kl_enabled(algo) and self.lora is not None and algo.ref_load is None:
            self.ref_model = AdapterDisabledReference(self.lora, self._reference_forward, self.packing)
        elif kl_enabled(algo):
            self.ref_model = ReferenceModel(
                algo.ref_load,
                self.model_path,
                self.device,
                dtype,
                routing_replay=self.routing_replay,
                fp32_lm_head=cfg.fp32_lm_head,
            )
        self.critic = None
        if uses_critic(algo):
            self.critic = Critic(cfg, algo, self.model_path, self.device, dtype)
        self.steps_done = 0
        # keep the entropies' graph even without an entropy term (what every step did before the entropy became a
        # no-grad metric there; bench/train_pass.py compares the two)
        self.always_entropy_graph = False

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps: every parameter, or with LoRA the adapter's alone."""
        if self.lora is not None:
            return self.lora.trainable_parameters()
        return [p for p in self.model.parameters() if p.requires_grad]  # a frozen vision tower is not stepped

    def _reference_forward(self, samples: list[Sample], packing: bool) -> list[torch.Tensor]:
        return response_log_probs(
            self.model, samples, self.device, packing=packing, routing_replay=self.routing_replay
        )[0]

    def use_packing(self, on: bool) -> None:
        """Packed rows (``True``, the default where the model can switch its attention) or left-padded batches
        (``False``, the reference path; see :func:`response_log_probs`) for the policy's, the reference model's and
        the critic's forward passes."""
        self.packing = on
        for other in (self.ref_model, self.critic):
            if other is not None:
                other.packing = on

    # -- what the shared RL step needs (vime_core.trainer.rl_step.PolicyOps) ----------------------------------
    @property
    def loss_device(self) -> torch.device:
        return self.device

    def policy_log_probs(
        self, samples: list[Sample], with_entropy: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Log-probs (and entropies) of each sample's response tokens, ``[response_length]`` float32 each (graph
        attached; the entropies' only with ``--entropy-coef`` != 0, the only loss term that differentiates them);
        see :func:`response_log_probs`."""
        return response_log_probs(
            self.model,
            samples,
            self.device,
            with_entropy=with_entropy,
            entropy_grad=self.always_entropy_graph or self.algorithm_config.entropy_coef != 0,
            packing=self.packing,
            routing_replay=self.routing_replay,
        )

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> float:
        """Clip to ``--clip-grad`` and step AdamW; the gradient norm before clipping.

        :raises FloatingPointError: on a non-finite gradient norm (no update is made).
        """
        return clip_and_step(
            self.trainable_parameters(),
            self.optimizer,
            self.trainer_config.clip_grad,
            f"grad norm at train step {self.steps_done}:",
        )

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """One RL step on ``batch``: :func:`vime_core.trainer.rl_step.rl_train_step` (shared by every backend; its
        docstring lists the order, the metrics and the errors)."""
        return rl_train_step(self, batch)

    # -- weights ---------------------------------------------------------------------------------------------------
    def named_hf_tensors(self, device: str | None = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's HF names and tensors (detached, contiguous) on ``device`` (``None``: where the model is),
        what vLLM and ``from_pretrained`` load: transformers' in-memory layout turned back into the saved one where
        they differ (MoE experts: per-expert ``mlp.experts.{e}.*_proj.weight``, not the fused ``gate_up_proj``;
        ``transformers.core_model_loading.revert_weight_conversion``, as ``save_pretrained`` does); a tied
        ``lm_head.weight`` is left out (vLLM ties it). With LoRA: the merged weights
        (:meth:`~vime_core.trainer.lora_torch.LoraModel.merged_tensors`). A vision-language model's tensors go under
        their checkpoint names, a frozen vision tower's left out
        (:func:`~vime_core.trainer.vision.named_checkpoint_tensors`)."""
        yield from self._hf_tensors(device, skip_frozen=True)

    def _hf_tensors(self, device: str | None, skip_frozen: bool) -> Iterator[tuple[str, torch.Tensor]]:
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        if self.lora is not None:
            items = self.lora.merged_tensors()
        elif is_vl_model(self.model):  # renamed below (named_checkpoint_tensors: a pure renaming)
            items = self.model.state_dict().items()
        else:
            items = checkpoint_layout(self.model, self.model.state_dict()).items()
        if is_vl_model(self.model):
            items = named_checkpoint_tensors(self.model, items, skip_vision=skip_frozen and self.vision_frozen)
        for name, tensor in items:
            if tied and name == "lm_head.weight":
                continue
            t = tensor.detach()
            yield name, (t if device is None else t.to(device)).contiguous()

    def lora_adapter(self) -> tuple[dict[str, torch.Tensor], dict]:
        """LoRA: the adapter's tensors (PEFT's saved names, CPU) and its ``adapter_config.json`` content
        (:func:`~vime_core.trainer.base.lora_adapter_of`). :raises RuntimeError: without ``--lora-rank``."""
        return lora_adapter_of(self.lora)

    def save_adapter(self, path: Path) -> None:
        """LoRA: the PEFT adapter directory (``final_adapter/``) that ``peft`` and ``vllm serve --lora-modules``
        load. :raises RuntimeError: without ``--lora-rank``."""
        if self.lora is None:
            raise RuntimeError("save_adapter: this run trains every weight (--lora-rank 0)")
        self.lora.save_adapter(Path(path))

    def save_hf(self, path: Path) -> None:
        """``save_pretrained`` of model (safetensors) and tokenizer to ``path``; with LoRA the merged model (the
        base config and the merged weights, :meth:`named_hf_tensors`)."""
        from transformers import AutoTokenizer

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:
            self.model.config.save_pretrained(str(path))
            save_file(dict(self.named_hf_tensors()), str(path / "model.safetensors"), metadata={"format": "pt"})
        else:
            self.model.save_pretrained(str(path), safe_serialization=True)
        AutoTokenizer.from_pretrained(str(self.model_path)).save_pretrained(str(path))
        gen = self.model_path / "generation_config.json"
        if gen.exists() and not (path / "generation_config.json").exists():
            (path / "generation_config.json").write_bytes(gen.read_bytes())

    def save_checkpoint(self, path: Path) -> None:
        """Weights as safetensors (HF names; with LoRA the PEFT adapter under ``adapter/`` instead) plus
        ``optimizer.pt`` and ``trainer_state.pt`` (optimizer-step counts,
        which place the learning-rate schedules, and the RNG state of Python, numpy, torch and CUDA:
        :mod:`vime_core.trainer.rng_state`); with ``ppo`` the critic (weights and optimizer)
        under ``critic/`` (:meth:`~vime_core.trainer.critic.Critic.save`)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:  # the adapter alone: the base weights never change
            self.lora.save_adapter(path / "adapter")
        elif is_vl_model(self.model):  # under the checkpoint names, every tensor (load_checkpoint maps them back)
            save_file(dict(self._hf_tensors("cpu", skip_frozen=False)), str(path / "model.safetensors"))
        else:  # the in-memory names, which load_checkpoint's load_state_dict reads back
            tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
            state = {k: t.detach().cpu().contiguous() for k, t in self.model.state_dict().items()}
            save_file(
                {k: t for k, t in state.items() if not (tied and k == "lm_head.weight")},
                str(path / "model.safetensors"),
            )
        torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
        if self.critic is not None:
            self.critic.save(path / "critic")
        save_trainer_state(path, self)

    def load_checkpoint(self, path: Path) -> None:
        """Restore weights, optimizer and RNG state (and the critic, with ``ppo``) written by :meth:`save_checkpoint`.

        :raises FileNotFoundError: if a file is missing (the critic's included).
        """
        from safetensors.torch import load_file

        path = Path(path)
        if self.lora is not None:
            adapter = path / "adapter" / "adapter_model.safetensors"
            self.lora.load_adapter_state(load_file(str(adapter)), f"checkpoint {path}")
        else:
            state = load_file(str(path / "model.safetensors"))
            if is_vl_model(self.model):  # saved under checkpoint names (_hf_tensors)
                back = {new: old for old, new in checkpoint_names(self.model, self.model.state_dict()).items()}
                state = {back.get(name, name): t for name, t in state.items()}
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            missing = [m for m in missing if m != "lm_head.weight"]
            if missing or unexpected:
                raise ValueError(f"checkpoint {path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
            if getattr(self.model.config, "tie_word_embeddings", False):
                self.model.tie_weights()
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
        if self.critic is not None:
            self.critic.load(path / "critic")
        load_trainer_state(path, self)
