"""Prompt encoding (:func:`encode_prompt`; with images :func:`encode_sample_prompt`) and the prompt checks that need
the policy's tokenizer: the tokenizer itself, the chat template, the prompt length.

``vime run`` makes them on the driver before any engine starts (:func:`check_prompts`), so a model directory
without a tokenizer, a missing chat template or an over-long prompt fails in seconds with the flag, the directory
or the file and line named; the rollout manager applies the same length filter to its buffer
(:func:`filter_overlong_prompts`).

Over-long prompts follow slime's ``--rollout-max-prompt-len``: a prompt with more tokens (after the chat template)
is left out of the buffer and counted (``data/overlong_prompts_filtered`` in every step's metrics); with
``--no-filter-overlong-prompts`` the first one is an error instead.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from vime_core.config import DataConfig
from vime_core.data.source import DataError
from vime_core.data.vision_prompt import (
    VisionModelError,
    check_vision_model,
    encode_with_images,
    load_processor,
    processor_for,
)

logger = logging.getLogger("vime.data")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def encode_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]], apply_chat_template: bool) -> list[int]:
    """Prompt token ids: chat messages go through the tokenizer's chat template (with the generation prompt);
    a string is tokenised as is, or wrapped as one user message when ``apply_chat_template``.

    :raises ValueError: if messages are given but the tokenizer has no chat template.
    """
    if isinstance(prompt, str) and not apply_chat_template:
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("prompt is a list of chat messages but the tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def encode_sample_prompt(
    tokenizer: Any, prompt: str | list[dict[str, Any]], images: list[str] | None, apply_chat_template: bool
) -> list[int]:
    """:func:`encode_prompt`, or for a prompt with images the model's processor: its chat template, every image
    placeholder expanded (:func:`vime_core.data.vision_prompt.encode_with_images`; the processor of the directory
    ``tokenizer`` came from).

    :raises ValueError: images with ``--no-apply-chat-template`` or with a string prompt (the data buffer turns a
        string prompt with images into chat messages), or a different number of images and image parts.
    """
    if not images:
        return encode_prompt(tokenizer, prompt, apply_chat_template)
    if not apply_chat_template:
        raise ValueError("a prompt with images needs the chat template (--no-apply-chat-template is set)")
    if isinstance(prompt, str):
        raise ValueError("a prompt with images must be chat messages with an image part per image")
    return encode_with_images(processor_for(tokenizer), prompt, images)


def load_tokenizer(model_path: Path) -> Any:
    """``AutoTokenizer.from_pretrained(model_path)``.

    :raises DataError: naming ``--model`` and the directory when it has no tokenizer files or they do not load.
    """
    from transformers import AutoTokenizer

    model_path = Path(model_path)
    if not any((model_path / name).is_file() for name in TOKENIZER_FILES):
        raise DataError(
            f"--model {model_path}: no tokenizer in the model directory (none of {', '.join(TOKENIZER_FILES)}); "
            "copy the tokenizer files of the base model there"
        )
    try:
        return AutoTokenizer.from_pretrained(str(model_path))
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a broken tokenizer
        raise DataError(f"--model {model_path}: the tokenizer does not load ({type(e).__name__}: {e})") from None


def check_chat_template(tokenizer: Any, model_path: Path, rows: list[dict[str, Any]], apply: bool) -> None:
    """A chat template is needed when ``--apply-chat-template`` is on or a prompt is a list of chat messages.

    :raises DataError: naming ``--apply-chat-template`` (or the first message-list prompt's file and line) and
        the model directory.
    """
    if getattr(tokenizer, "chat_template", None):
        return
    if apply:
        raise DataError(
            f"--apply-chat-template is on but the tokenizer of --model {model_path} has no chat template "
            "(tokenizer_config.json has no 'chat_template' and there is no chat_template.jinja); pass "
            "--no-apply-chat-template to tokenize text prompts as they are, or use a model with a chat template"
        )
    for row in rows:
        if isinstance(row["prompt"], list):
            raise DataError(
                f"{row.get('where', '--prompt-data')}: the prompt is a list of chat messages but the tokenizer of "
                f"--model {model_path} has no chat template"
            )


def filter_overlong_prompts(
    rows: list[dict[str, Any]], tokenizer: Any, data: DataConfig
) -> tuple[list[dict[str, Any]], int]:
    """Leave out the prompts longer than ``--rollout-max-prompt-len`` tokens (as the engines get them: through the
    chat template when :func:`encode_prompt` applies it); no limit: ``rows`` as is.

    :return: ``(kept rows, number left out)``.
    :raises DataError: with ``--no-filter-overlong-prompts``, naming the first over-long prompt's file and line,
        its length and the limit; also when every prompt is over-long.
    """
    limit = data.rollout_max_prompt_len
    if not limit:
        return rows, 0
    kept = []
    for row in rows:
        n = len(encode_sample_prompt(tokenizer, row["prompt"], row.get("images"), data.apply_chat_template))
        if n <= limit:
            kept.append(row)
        elif not data.filter_overlong_prompts:
            raise DataError(
                f"{row.get('where', '--prompt-data')}: the prompt has {n} tokens, more than --rollout-max-prompt-len "
                f"{limit} (--filter-overlong-prompts leaves such prompts out instead)"
            )
    if not kept:
        raise DataError(
            f"--prompt-data {data.prompt_data}: every prompt has more than --rollout-max-prompt-len {limit} tokens"
        )
    if len(kept) < len(rows):
        logger.warning(
            "left out %d of %d prompts longer than --rollout-max-prompt-len %d",
            len(rows) - len(kept),
            len(rows),
            limit,
        )
    return kept, len(rows) - len(kept)


def check_images(rows: list[dict[str, Any]], model_path: Path, apply_chat_template: bool) -> None:
    """Rows with images need a vision-language model vime drives, whose processor loads, and the chat template.

    :raises DataError: naming the first row with images and ``--model`` (a text-only or unsupported model, a
        processor that does not load), or ``--no-apply-chat-template``.
    """
    first = next((row for row in rows if row.get("images")), None)
    if first is None:
        return
    where = first.get("where", "--prompt-data")
    try:
        check_vision_model(model_path)
        load_processor(str(model_path))
    except VisionModelError as e:
        raise DataError(f"{where} has images, but {e}") from None
    if not apply_chat_template:
        raise DataError(f"{where} has images, which need the chat template: drop --no-apply-chat-template")


def check_prompts(data: DataConfig, model_path: Path, rows: list[dict[str, Any]]) -> int:
    """Everything above for ``vime run``'s ``--prompt-data`` rows, on the driver before any engine starts.

    :return: the number of over-long prompts left out.
    :raises DataError: see :func:`load_tokenizer`, :func:`check_chat_template`, :func:`filter_overlong_prompts`.
    """
    tokenizer = load_tokenizer(model_path)
    check_images(rows, model_path, data.apply_chat_template)
    if data.generate == "default":  # other generate functions bring their own templates (e.g. multi_turn's)
        check_chat_template(tokenizer, model_path, rows, data.apply_chat_template)
    return filter_overlong_prompts(rows, tokenizer, data)[1]
