"""The torch trainer's side of vision-language models: the model class, the image inputs and multimodal RoPE
positions of a micro-batch, the frozen vision tower, and the checkpoint names the engines load.

A VLM sample's ``tokens`` already hold the processor's expanded image placeholders
(:mod:`vime_core.data.vision_prompt`); here its ``images`` become ``pixel_values`` / ``image_grid_thw`` through the
same processor, and each token gets Qwen-VL's three RoPE positions (:func:`mrope_positions`: temporal, height,
width), so the forward pass sees exactly what vLLM saw. Only response tokens are ever in the loss mask: image tokens
are prompt (or tool-result) tokens. Details: docs/vlm.md, "Trainer".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from vime_core.algorithms.logprobs import selected_log_probs_and_entropy
from vime_core.algorithms.options import uses_critic
from vime_core.config import RunConfig
from vime_core.data.vision_prompt import image_inputs, image_runs, is_vision_language, load_processor
from vime_core.trainer.padding import left_padded_batch, response_slices
from vime_core.types import Sample

#: attribute names of the vision tower in transformers' VLM classes (Qwen-VL: ``model.visual``)
VISION_TOWER_ATTRS = ("visual", "vision_tower", "vision_model")


def check_vl_run(config: RunConfig) -> None:
    """What a run of a vision-language model cannot do (yet); checked on the driver before Ray starts and again by
    the torch trainer.

    :raises ValueError: ``--trainer megatron`` (Megatron VLM training is not supported), ``--lora-rank`` > 0,
        ``--advantage-estimator ppo`` (a critic) or ``--use-rollout-routing-replay`` (the VLM forward pass replays no
        routes), naming the flag.
    """
    if config.trainer.trainer == "megatron":
        raise ValueError(
            "--trainer megatron: vision-language models train with --trainer torch (Megatron VLM training is not "
            "supported; docs/vlm.md)"
        )
    if config.lora.enabled:
        raise ValueError("--lora-rank: LoRA on a vision-language model is not supported yet (docs/vlm.md)")
    if uses_critic(config.algorithm):
        raise ValueError("--advantage-estimator ppo: a critic for a vision-language model is not supported yet")
    if config.algorithm.use_rollout_routing_replay:
        raise ValueError("--use-rollout-routing-replay: not supported yet for a vision-language model (docs/vlm.md)")


def load_hf_model(model_path: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """The policy (or reference) model: ``AutoModelForImageTextToText`` for a vision-language model directory
    (``config.json`` with a ``vision_config``), else ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cls = AutoModelForImageTextToText if is_vision_language(model_path) else AutoModelForCausalLM
    return cls.from_pretrained(str(model_path), dtype=dtype)


def is_vl_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a vision-language model (its config has a ``vision_config``)."""
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    """The vision encoder (with its merger/projector) of a transformers VLM.

    :raises ValueError: if none of :data:`VISION_TOWER_ATTRS` is found on the model or its ``model``.
    """
    for owner in (getattr(model, "model", None), model):
        for attr in VISION_TOWER_ATTRS:
            tower = getattr(owner, attr, None) if owner is not None else None
            if isinstance(tower, torch.nn.Module):
                return tower
    raise ValueError(f"{type(model).__name__} has no vision tower attribute ({', '.join(VISION_TOWER_ATTRS)})")


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Stop the vision tower's parameters from training (``requires_grad=False``; the optimizer skips them).

    :return: the number of parameters frozen.
    """
    params = list(vision_tower(model).parameters())
    for p in params:
        p.requires_grad_(False)
    return sum(p.numel() for p in params)


def vision_param_names(model: torch.nn.Module) -> set[str]:
    """The ``state_dict`` names of the vision tower's tensors (``model.visual.…`` for Qwen-VL)."""
    tower = vision_tower(model)
    prefix = next(name for name, module in model.named_modules() if module is tower)
    return {name for name in model.state_dict() if name.startswith(prefix + ".")}


def checkpoint_names(model: torch.nn.Module, names: Iterable[str]) -> dict[str, str]:
    """``{state_dict name: checkpoint name}``: the names ``save_pretrained`` writes (transformers 5 renames a
    Qwen-VL's ``model.language_model.layers.0…`` to ``model.layers.0…`` and ``model.visual.…`` to ``visual.…``),
    which are what a checkpoint holds and what vLLM and vime's engine-side load check expect.

    :raises ValueError: if the conversion is not a pure renaming (one name in, one name out).
    """
    from transformers.core_model_loading import revert_weight_conversion

    names = list(names)
    # placeholders stand for the tensors: the renaming keeps each one, so identity maps old names to new
    placeholders = {n: torch.empty(0) for n in names}
    old_of = {id(t): n for n, t in placeholders.items()}
    out: dict[str, str] = {}
    for new_name, t in revert_weight_conversion(model, placeholders).items():
        old = old_of.get(id(t))
        if old is None or old in out:
            raise ValueError(f"{type(model).__name__}: its checkpoint conversion is not a renaming ({new_name})")
        out[old] = new_name
    if len(out) != len(names):
        raise ValueError(f"{type(model).__name__}: its checkpoint conversion is not a renaming")
    return out


def named_checkpoint_tensors(
    model: torch.nn.Module, items: Iterable[tuple[str, torch.Tensor]], skip_vision: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """``items`` (``state_dict``-named tensors of ``model``) under their checkpoint names (:func:`checkpoint_names`),
    the vision tower's left out when ``skip_vision`` (a frozen tower never changes, so the engines keep theirs)."""
    items = list(items)
    names = checkpoint_names(model, [n for n, _ in items])
    skipped = vision_param_names(model) if skip_vision else set()
    for name, tensor in items:
        if name not in skipped:
            yield names[name], tensor


def mrope_positions(tokens: list[int], grids: list[list[int]], image_token_id: int, merge: int) -> torch.Tensor:
    """Qwen-VL's multimodal RoPE positions of one sequence of images and text (Qwen2-VL, arXiv:2409.12191, §2.1;
    transformers' ``get_rope_index``, vLLM's ``MRotaryEmbedding``).

    Text tokens count up by one on all three axes. An image's run of ``t·(h/merge)·(w/merge)`` placeholder tokens
    starts at the next position ``s`` and gives token ``(i, j, k)`` of its grid the positions
    ``(s + i, s + j, s + k)``; the text after it continues at ``s + max(t, h/merge, w/merge)``.

    :param tokens: the sequence (prompt + response) with every image's placeholder run expanded.
    :param grids: each image's ``[t, h, w]`` patch grid (``image_grid_thw``), in run order.
    :param image_token_id: the placeholder token.
    :param merge: the spatial merge size (2 for Qwen-VL).
    :return: ``[3, len(tokens)]`` int64.
    :raises ValueError: if the placeholder runs do not match the grids (count or lengths).
    """
    runs = image_runs(tokens, image_token_id)
    sizes = [t * (h // merge) * (w // merge) for t, h, w in grids]
    if [n for _, n in runs] != sizes:
        raise ValueError(f"image placeholder runs {[n for _, n in runs]} in the tokens, but the grids need {sizes}")
    pieces = []
    pos = prev = 0
    for (start, n), (t, h, w) in zip(runs, grids, strict=True):
        text = start - prev
        pieces.append(torch.arange(text).expand(3, -1) + pos)
        pos += text
        gh, gw = h // merge, w // merge
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")).reshape(
            3, -1
        )
        pieces.append(grid + pos)
        pos += max(t, gh, gw)
        prev = start + n
    pieces.append(torch.arange(len(tokens) - prev).expand(3, -1) + pos)
    return torch.cat(pieces, dim=1).long()


def vl_batch_inputs(model: torch.nn.Module, samples: list[Sample], device: torch.device) -> dict[str, Any]:
    """The forward inputs of a left-padded micro-batch of VLM samples: ``input_ids``, ``attention_mask``,
    ``position_ids`` ``[3, B, L]`` (padding positions 0), and for the batch's images ``pixel_values`` and
    ``image_grid_thw`` (samples in order, each sample's images in order); plus ``keep`` (the last positions that
    hold every response token and the one before)."""
    config = model.config
    processor = load_processor(str(config._name_or_path))
    merge = int(config.vision_config.spatial_merge_size)
    batch = left_padded_batch(samples, device)
    positions = torch.zeros((3, len(samples), batch.seq_len), dtype=torch.long)
    pixels, grids = [], []
    for i, s in enumerate(samples):
        grid: list[list[int]] = []
        if s.images:
            inputs = image_inputs(processor, s.images)
            pixels.append(inputs["pixel_values"])
            grids.append(inputs["image_grid_thw"])
            grid = inputs["image_grid_thw"].tolist()
        positions[:, i, batch.seq_len - len(s.tokens) :] = mrope_positions(
            s.tokens, grid, int(config.image_token_id), merge
        )
    out: dict[str, Any] = {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "position_ids": positions.to(device),
        "keep": batch.keep,
    }
    if pixels:
        out["pixel_values"] = torch.cat(pixels).to(device=device, dtype=model.dtype)
        out["image_grid_thw"] = torch.cat(grids).to(device)
    return out


def vl_response_log_probs(
    model: torch.nn.Module,
    samples: list[Sample],
    device: torch.device,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """:func:`vime_core.trainer.torch_backend.response_log_probs` for a vision-language model: one left-padded
    forward pass with the samples' images (:func:`vl_batch_inputs`), the LM head on the last ``keep`` positions.

    :return: ``(log_probs, entropies)``, one ``[response_length]`` float32 tensor per sample each (graph attached
        when grad is enabled); ``entropies`` is None unless ``with_entropy``.
    :raises ValueError: if a sample's placeholder runs do not match its images.
    """
    inputs = vl_batch_inputs(model, samples, device)
    keep = inputs.pop("keep")
    logits = model(**inputs, logits_to_keep=keep, use_cache=False).logits
    ids = inputs["input_ids"]
    tail = ids[:, ids.shape[1] - keep :]
    rows = logits[:, :-1].reshape(-1, logits.shape[-1])
    lp, ent = selected_log_probs_and_entropy(rows, tail[:, 1:].reshape(-1), with_entropy, entropy_grad)
    lp = lp.view(len(samples), keep - 1)
    return response_slices(lp, samples), None if ent is None else response_slices(ent.view_as(lp), samples)
