"""Geometry questions on figures drawn here (geo3k-style): triangles, right triangles, circles, angles on a line and
rectangles, each with labelled measures and one numeric answer, for the ``math`` reward.

    python examples/geo3k_vlm/make_data.py                  # data/ (train 64, eval 16) — checked in
    python examples/geo3k_vlm/make_data.py --tiny-model     # also the tiny random VLM of the CPU config

Writes ``data/figures/<id>.png`` (224×224 RGB) and ``data/{train,eval}.jsonl`` rows ``{"problem": "<image>...",
"answer": "70", "images": ["figures/<id>.png"], "metadata": {"figure": "<id>", "kind": ..., "measures": {...}}}``:
the ``<image>`` marker is where the figure goes, the path is relative to the data file (``--image-key images``).
Deterministic for a given ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SIZE = 224
INSTRUCTION = " Put the final answer (a number) in \\boxed{}."


def _font(size: int = 15) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: the bitmap font only
        return ImageFont.load_default()


def _canvas() -> tuple[Any, Any]:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIZE, SIZE), "white")
    return img, ImageDraw.Draw(img)


def triangle(rng: random.Random) -> tuple[Any, str, str, dict[str, Any]]:
    """Two labelled angles of a triangle; x is the third (180 minus their sum)."""
    a, b = rng.randrange(30, 81, 5), rng.randrange(30, 81, 5)
    img, d = _canvas()
    pts = [(30, 180), (194, 180), (rng.randrange(70, 155), 40)]
    d.polygon(pts, outline="black", width=2)
    f = _font()
    d.text((pts[0][0] + 18, pts[0][1] - 22), f"{a}°", fill="blue", font=f)
    d.text((pts[1][0] - 40, pts[1][1] - 22), f"{b}°", fill="blue", font=f)
    d.text((pts[2][0] - 6, pts[2][1] + 14), "x", fill="red", font=f)
    for label, (px, py), (dx, dy) in zip("ABC", pts, [(-16, 2), (6, 2), (-5, -20)], strict=True):
        d.text((px + dx, py + dy), label, fill="black", font=f)
    q = "<image>In triangle ABC, find the measure x of angle C in degrees."
    return img, q, str(180 - a - b), {"angle_A": a, "angle_B": b}


def right_triangle(rng: random.Random) -> tuple[Any, str, str, dict[str, Any]]:
    """The legs of a right triangle (a Pythagorean triple); x is the hypotenuse."""
    p, q_, r = rng.choice([(3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25), (6, 8, 10), (9, 12, 15)])
    img, d = _canvas()
    scale = 150 / max(p, q_)
    w, h = int(q_ * scale), int(p * scale)
    pts = [(35, 190), (35 + w, 190), (35, 190 - h)]
    d.polygon(pts, outline="black", width=2)
    d.rectangle((35, 176, 49, 190), outline="black")
    f = _font()
    d.text((35 + w // 2 - 6, 194), str(q_), fill="blue", font=f)
    d.text((14, 190 - h // 2 - 8), str(p), fill="blue", font=f)
    d.text((35 + w // 2 + 6, 190 - h // 2 - 18), "x", fill="red", font=f)
    q = "<image>The triangle has a right angle. Find the length x of its hypotenuse."
    return img, q, str(r), {"legs": [p, q_]}


def circle(rng: random.Random) -> tuple[Any, str, str, dict[str, Any]]:
    """A circle with its radius labelled; x is the diameter."""
    r = rng.randrange(3, 40)
    img, d = _canvas()
    c, rad = SIZE // 2, 80
    d.ellipse((c - rad, c - rad, c + rad, c + rad), outline="black", width=2)
    ang = rng.uniform(0, 2 * math.pi)
    end = (c + rad * math.cos(ang), c - rad * math.sin(ang))
    d.line((c, c, *end), fill="blue", width=2)
    d.ellipse((c - 3, c - 3, c + 3, c + 3), fill="black")
    f = _font()
    d.text(((c + end[0]) / 2 + 4, (c + end[1]) / 2 - 16), str(r), fill="blue", font=f)
    d.text((c - 4, c + rad + 4), "O", fill="black", font=f)
    q = "<image>The labelled segment is a radius of circle O. Find the diameter x of the circle."
    return img, q, str(2 * r), {"radius": r}


def straight_angle(rng: random.Random) -> tuple[Any, str, str, dict[str, Any]]:
    """Two angles on a straight line, one labelled; x is the other."""
    a = rng.randrange(25, 156, 5)
    img, d = _canvas()
    c = (SIZE // 2, 150)
    d.line((20, c[1], SIZE - 20, c[1]), fill="black", width=2)
    ang = math.radians(a)
    end = (c[0] + 100 * math.cos(math.pi - ang), c[1] - 100 * math.sin(math.pi - ang))
    d.line((*c, *end), fill="black", width=2)
    f = _font()
    d.text((c[0] - 48, c[1] - 24), f"{a}°", fill="blue", font=f)
    d.text((c[0] + 26, c[1] - 24), "x", fill="red", font=f)
    q = "<image>The two angles lie on a straight line. Find x in degrees."
    return img, q, str(180 - a), {"angle": a}


def rectangle(rng: random.Random) -> tuple[Any, str, str, dict[str, Any]]:
    """A rectangle with its sides labelled; x is its area."""
    w, h = rng.randrange(2, 13), rng.randrange(2, 13)
    img, d = _canvas()
    scale = 150 / max(w, h)
    pw, ph = int(w * scale), int(h * scale)
    x0, y0 = (SIZE - pw) // 2, (SIZE - ph) // 2
    d.rectangle((x0, y0, x0 + pw, y0 + ph), outline="black", width=2)
    f = _font()
    d.text((x0 + pw // 2 - 6, y0 + ph + 4), str(w), fill="blue", font=f)
    d.text((x0 - 22, y0 + ph // 2 - 8), str(h), fill="blue", font=f)
    q = "<image>Find the area x of the rectangle."
    return img, q, str(w * h), {"width": w, "height": h}


KINDS = {
    "triangle": triangle,
    "right_triangle": right_triangle,
    "circle": circle,
    "straight_angle": straight_angle,
    "rectangle": rectangle,
}


def make_rows(out_dir: Path, split: str, n: int, seed: int, prompt_suffix: str = INSTRUCTION) -> list[dict]:
    """Draw ``n`` figures into ``out_dir/figures`` and return their rows (kinds in turn, measures random)."""
    rng = random.Random(f"{seed}-{split}")
    (out_dir / "figures").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        kind = list(KINDS)[i % len(KINDS)]
        img, question, answer, measures = KINDS[kind](rng)
        figure = f"{split}_{i:03d}"
        img.save(out_dir / "figures" / f"{figure}.png", format="PNG", optimize=True)
        rows.append(
            {
                "problem": question + prompt_suffix,
                "answer": answer,
                "images": [f"figures/{figure}.png"],
                "metadata": {"figure": figure, "kind": kind, "measures": measures},
            }
        )
    return rows


def write(out_dir: Path, n_train: int, n_eval: int, seed: int, prompt_suffix: str = INSTRUCTION) -> None:
    for split, n in (("train", n_train), ("eval", n_eval)):
        rows = make_rows(out_dir, split, n, seed, prompt_suffix)
        (out_dir / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {len(rows)} rows to {out_dir / f'{split}.jsonl'}")


def build_tiny_model(path: Path) -> None:
    from vime_core.testing.tiny_vlm import build_tiny_vlm

    print(f"tiny random Qwen2.5-VL model: {build_tiny_vlm(path.expanduser())}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=HERE / "data")
    p.add_argument("--train", type=int, default=64)
    p.add_argument("--eval", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tiny-model",
        nargs="?",
        const=Path("~/.cache/vime/models/tiny-qwen2.5-vl"),
        type=Path,
        help="also build the CPU config's tiny random VLM (default ~/.cache/vime/models/tiny-qwen2.5-vl)",
    )
    args = p.parse_args()
    write(args.out, args.train, args.eval, args.seed)
    if args.tiny_model:
        build_tiny_model(args.tiny_model)


if __name__ == "__main__":
    main()
