"""A vision-language prompt's images on the generate request: the policy's placeholder token ids, and the request
fields each vLLM release takes images in with token ids (``content_parts`` on 0.32+, rendered ``features`` on 0.24;
:attr:`vime_core.engines.engine_api.EngineCapabilities.image_input`). Used by
:class:`vime_core.engines.client.RouterClient`; docs/vlm.md, "Rollout"."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from vime_core.engines.answers import RouterClientError, _field
from vime_core.engines.engine_api import RENDER_ROUTE

#: the ``config.json`` keys of a vision-language model's placeholder tokens (Qwen-VL's names)
VISION_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def vision_token_ids(model_dir: str | Path | None) -> dict[str, int]:
    """The placeholder token ids of a vision-language model (:data:`VISION_TOKEN_KEYS` found in
    ``model_dir/config.json``); ``{}`` for a text model or without a readable config."""
    path = Path(model_dir) / "config.json" if model_dir else None
    if path is None or not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {k: int(config[k]) for k in VISION_TOKEN_KEYS if isinstance(config.get(k), int)}


def token_runs(tokens: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """``(start, length)`` of every maximal run of ``token_id`` in ``tokens`` (a prompt's image placeholders)."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(tokens):
        if t != token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def content_parts_fields(images: list[str], prompt_token_ids: list[int], pad: int) -> dict[str, Any]:
    """0.32+: the server loads and processes the images and expands one placeholder per image itself (it would
    expand an already expanded run again), so the ids go with each run of ``pad`` cut to one token, the images as
    ``content_parts``, and ``return_token_ids`` asks for the engine's expanded prompt (:func:`check_engine_prompt`).

    :raises RouterClientError: if the number of placeholder runs is not the number of images.
    """
    runs = token_runs(prompt_token_ids, pad)
    if len(runs) != len(images):
        raise RouterClientError(f"{len(images)} images but {len(runs)} image placeholder runs in the prompt")
    ids: list[int] = []
    prev = 0
    for start, n in runs:
        ids += prompt_token_ids[prev : start + 1]
        prev = start + n
    ids += prompt_token_ids[prev:]
    parts = [{"type": "image_url", "url": u} for u in images]
    return {"token_ids": ids, "content_parts": parts, "return_token_ids": True}


async def features_fields(
    http: httpx.AsyncClient, base_url: str, images: list[str], prompt_token_ids: list[int], model: str
) -> dict[str, Any]:
    """0.24: the images rendered by ``POST /v1/chat/completions/render`` (:data:`RENDER_ROUTE`) into ``features``,
    their placeholder ranges moved onto ``prompt_token_ids``' image runs (the ids are sent as they are).

    :raises RouterClientError: a render that fails, or image runs in ``prompt_token_ids`` that do not match the
        rendered images (their number or lengths).
    """
    where = f"POST {base_url}{RENDER_ROUTE}"
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in images]
    body = {"model": model, "messages": [{"role": "user", "content": parts}]}
    resp = await http.post(RENDER_ROUTE, json=body)
    if resp.status_code != 200:
        raise RouterClientError(f"{where} returned {resp.status_code}: {resp.text[:2000]}")
    data = resp.json()
    features = dict(_field(data, "features", where) or {})
    ranges = (features.get("mm_placeholders") or {}).get("image") or []
    if len(ranges) != len(images):
        raise RouterClientError(f"{where}: {len(images)} images rendered into {len(ranges)} placeholder ranges")
    image_token = _field(data, "token_ids", where)[ranges[0]["offset"]]
    runs = token_runs(prompt_token_ids, image_token)
    if [n for _, n in runs] != [int(r["length"]) for r in ranges]:
        raise RouterClientError(
            f"{where}: the prompt's image placeholder runs {[n for _, n in runs]} (token {image_token}) differ "
            f"from the rendered images' {[int(r['length']) for r in ranges]}"
        )
    features["mm_placeholders"] = {"image": [{"offset": start, "length": n} for start, n in runs]}
    return {"features": features}


def check_engine_prompt(engine_prompt: list[int] | None, prompt_token_ids: list[int], where: str) -> None:
    """With ``content_parts`` the engine expanded the image placeholders itself: its prompt (``prompt_token_ids``
    echoed by ``return_token_ids``) must be the processor's, token for token.

    :raises RouterClientError: naming both prompts (the engine's missing included).
    """
    if engine_prompt != list(prompt_token_ids):
        raise RouterClientError(
            f"{where}: the engine's prompt with the images expanded ({engine_prompt!r:.300}) is not "
            f"the processor's ({list(prompt_token_ids)!r:.300})"
        )
