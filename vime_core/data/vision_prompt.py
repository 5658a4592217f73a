"""Prompt token ids of a vision-language model: the model's own processor renders and expands the image placeholders.

A Qwen-VL chat template writes one ``<|image_pad|>`` per image; the processor expands it into as many pads as the
image has visual tokens (its ``image_grid_thw`` product over the merge size squared). The prompt ids vime sends to
vLLM and trains on are exactly the processor's (:func:`encode_with_images`); images that arrive later (a tool result
in ``multi_turn``, a user turn through the agent gateway) are expanded the same way (:func:`expand_image_pads`).
Supported models and how the ids are checked: docs/vlm.md.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vime_core.data.images import count_image_parts, decode_image, load_image, part_image

#: ``model_type`` values whose processor vime drives (the Qwen-VL family: ``image_grid_thw`` and multimodal RoPE)
SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


class VisionModelError(ValueError):
    """A model directory that cannot take images (text-only, an unsupported VLM, a processor that does not load)."""


def model_type(model_path: str | Path) -> str | None:
    """``model_type`` of ``model_path/config.json`` (``None`` when there is no readable config)."""
    try:
        return json.loads((Path(model_path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def is_vision_language(model_path: str | Path) -> bool:
    """Whether ``model_path`` holds a vision-language model (its ``config.json`` has a ``vision_config``)."""
    try:
        return "vision_config" in json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def check_vision_model(model_path: str | Path, flag: str = "--model") -> None:
    """:raises VisionModelError: unless ``model_path`` is a VLM of :data:`SUPPORTED_MODEL_TYPES` (the message names
    ``flag``, the directory and its ``model_type``)."""
    kind = model_type(model_path)
    if not is_vision_language(model_path):
        raise VisionModelError(
            f"{flag} {model_path} is a text-only model ({kind}): its prompts cannot have images; use a "
            "vision-language model (docs/vlm.md lists them)"
        )
    if kind not in SUPPORTED_MODEL_TYPES:
        raise VisionModelError(
            f"{flag} {model_path}: model_type {kind!r} is a vision-language model vime does not drive yet "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}; docs/vlm.md)"
        )


@functools.lru_cache(maxsize=4)
def load_processor(model_path: str) -> Any:
    """The model's Hugging Face processor (``AutoProcessor``), cached per path.

    :raises VisionModelError: naming the directory when the processor does not load (the transformers error says
        why: a missing ``preprocessor_config.json``, torchvision not installed, ...).
    """
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model_path)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a processor that does not load
        raise VisionModelError(
            f"the processor of {model_path} does not load ({type(e).__name__}: {str(e).strip()[:500]}); "
            "docs/vlm.md, 'torchvision on the CPU'"
        ) from None


def processor_for(tokenizer: Any) -> Any:
    """:func:`load_processor` of the directory ``tokenizer`` was loaded from (``name_or_path``)."""
    return load_processor(str(tokenizer.name_or_path))


def image_token_id(processor: Any) -> int:
    """The id of the processor's image placeholder token (``<|image_pad|>`` for Qwen-VL)."""
    return int(processor.image_token_id)


def _merge(processor: Any) -> int:
    return int(processor.image_processor.merge_size)


def image_inputs(processor: Any, images: Sequence[str]) -> dict[str, Any]:
    """The image processor's output for ``images`` (normalised ``data:`` URIs): ``pixel_values``
    ``[sum of patches, C·T·P·P]`` float32 and ``image_grid_thw`` ``[len(images), 3]`` int64 (torch tensors)."""
    out = processor.image_processor(images=[decode_image(u) for u in images], return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def image_token_counts(processor: Any, images: Sequence[str]) -> list[int]:
    """The number of placeholder tokens each image expands into: ``t·h·w / merge²`` of its ``image_grid_thw``."""
    if not images:
        return []
    grid = image_inputs(processor, images)["image_grid_thw"]
    return [int(n) for n in (grid.prod(-1) // _merge(processor) ** 2).tolist()]


def encode_with_images(processor: Any, messages: list[dict[str, Any]], images: Sequence[str]) -> list[int]:
    """Prompt token ids of chat ``messages`` whose ``{"type": "image"}`` parts stand for ``images`` in order: the
    processor's chat template with the generation prompt, then the processor on that text and the images (image
    placeholders expanded), no special tokens added beyond the template's.

    :raises ValueError: if the number of image parts in ``messages`` differs from ``len(images)``.
    """
    if count_image_parts(messages) != len(images):
        raise ValueError(f"{count_image_parts(messages)} image parts in the messages but {len(images)} images")
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = processor(
        text=[text], images=[decode_image(u) for u in images] or None, add_special_tokens=False, return_tensors=None
    )
    ids = enc["input_ids"][0]
    return [int(t) for t in ids]


def image_runs(tokens: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """``(start, length)`` of every maximal run of ``token_id`` in ``tokens``, in order."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate(tokens):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            runs.append((start, i - start))
            start = None
    if start is not None:
        runs.append((start, len(tokens) - start))
    return runs


def expand_image_pads(tokens: Sequence[int], token_id: int, counts: Sequence[int]) -> list[int]:
    """``tokens`` with the ``k``-th single ``token_id`` (as a chat template writes one per image) repeated
    ``counts[k]`` times, as the processor expands them.

    :raises ValueError: if ``tokens`` holds a different number of ``token_id`` than ``len(counts)`` (or an already
        expanded run).
    """
    positions = [i for i, t in enumerate(tokens) if t == token_id]
    if len(positions) != len(counts):
        raise ValueError(f"{len(positions)} image placeholder tokens ({token_id}) for {len(counts)} images")
    out: list[int] = []
    prev = 0
    for pos, n in zip(positions, counts, strict=True):
        out.extend(tokens[prev:pos])
        out.extend([token_id] * n)
        prev = pos + 1
    out.extend(tokens[prev:])
    return out


def check_image_tokens(processor: Any, tokens: Sequence[int], images: Sequence[str], where: str) -> None:
    """Check that ``tokens`` has one placeholder run per image, each as long as the image's token count.

    :raises ValueError: naming ``where``, the runs found and the counts expected.
    """
    runs = image_runs(tokens, image_token_id(processor))
    counts = image_token_counts(processor, images)
    if [n for _, n in runs] != counts:
        raise ValueError(
            f"{where}: image placeholder runs {[n for _, n in runs]} in the tokens, but the {len(images)} images "
            f"need {counts}"
        )


@functools.lru_cache(maxsize=8)
def image_placeholder_text(processor: Any) -> str:
    """The text the processor's chat template writes for one image part (``<|vision_start|><|image_pad|>
    <|vision_end|>`` for Qwen-VL), found by rendering an image between two text parts.

    :raises VisionModelError: if the template writes no image between them.
    """
    before, after = "vime-text-before", "vime-text-after"
    parts = [{"type": "text", "text": before}, {"type": "image"}, {"type": "text", "text": after}]
    text = processor.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    start, end = text.find(before), text.find(after)
    if start < 0 or end < 0 or end <= start + len(before):
        raise VisionModelError("the processor's chat template writes nothing for an image part")
    return text[start + len(before) : end]


def messages_as_text(messages: list[dict[str, Any]], placeholder: str) -> list[dict[str, Any]]:
    """``messages`` with every content-part list joined into one string, each image part written as ``placeholder``
    (what Qwen-VL's template writes for parts: their texts back to back), for renderers that take text content."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            pieces = []
            for p in content:
                if part_image(p)[0]:
                    pieces.append(placeholder)
                else:
                    pieces.append(str(p.get("text", "")))
            m = {**m, "content": "".join(pieces)}
        out.append(m)
    return out


def tool_result_parts(result: str | list[dict[str, Any]], base_dir: Path) -> tuple[str, list[str]]:
    """A tool's result as ``(text, images)``: a string as it is; a list of content parts as its text parts joined
    and its image parts (``image_url`` or ``image``: a path, ``data:`` URI or bytes) loaded and normalised
    (:func:`vime_core.data.images.load_image`), in order.

    :raises vime_core.data.images.ImageDataError: an image part that cannot be loaded.
    """
    if isinstance(result, str):
        return result, []
    texts, images = [], []
    for p in result:
        is_image, ref = part_image(p)
        if is_image:
            images.append(load_image(ref, base_dir))
        else:
            texts.append(str(p.get("text", "")))
    return "".join(texts), images
