"""The geo3k_vlm_multi_turn tools: look closer at a figure (``zoom``: a magnified crop, returned as an image) or ask
for a labelled measure (``measure``). The figure is named in the prompt (``Figure: train_007``); the tools read it
from examples/geo3k_vlm/data/figures. ``multi_turn`` appends the crop to the episode as image tokens (context,
never trained) and sends it to the engine with the episode's other images (docs/vlm.md, "Multi-turn").
"""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path
from typing import Any

from vime_core.rollout.generators.tools import register_tool

DATA = Path(__file__).resolve().parents[1] / "geo3k_vlm" / "data"  # the figures and their measures
SIZE = 224
_FIGURE = re.compile(r"^(train|eval)_\d{3}$")


def _figure_path(figure: str) -> Path:
    if not _FIGURE.match(str(figure)):
        raise ValueError(f"unknown figure {figure!r}: use the name after 'Figure:' in the question")
    return DATA / "figures" / f"{figure}.png"


@register_tool
def zoom(figure: str, region: str) -> list[dict[str, Any]]:
    """Magnify one quarter of a figure: region is top-left, top-right, bottom-left, bottom-right or center."""
    from PIL import Image

    boxes = {
        "top-left": (0, 0, SIZE // 2, SIZE // 2),
        "top-right": (SIZE // 2, 0, SIZE, SIZE // 2),
        "bottom-left": (0, SIZE // 2, SIZE // 2, SIZE),
        "bottom-right": (SIZE // 2, SIZE // 2, SIZE, SIZE),
        "center": (SIZE // 4, SIZE // 4, 3 * SIZE // 4, 3 * SIZE // 4),
    }
    if region not in boxes:
        raise ValueError(f"region must be one of {', '.join(boxes)}")
    with Image.open(_figure_path(figure)) as img:
        crop = img.convert("RGB").crop(boxes[region]).resize((SIZE, SIZE), Image.Resampling.BICUBIC)
    out = io.BytesIO()
    crop.save(out, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode("ascii")
    return [
        {"type": "text", "text": f"{region} of {figure}, magnified 2x:"},
        {"type": "image_url", "image_url": {"url": uri}},
    ]


@register_tool
def measure(figure: str, name: str) -> str:
    """The value of a labelled measure of a figure (e.g. angle_A, legs, radius, width), from its metadata."""
    for split in ("train", "eval"):
        for line in (DATA / f"{split}.jsonl").read_text().splitlines():
            meta = json.loads(line)["metadata"]
            if meta["figure"] == figure:
                if name not in meta["measures"]:
                    return f"{figure} has no measure {name!r}; it has {', '.join(sorted(meta['measures']))}"
                return json.dumps(meta["measures"][name])
    _figure_path(figure)  # a malformed name: the same message as zoom's
    return f"no figure {figure!r}"
