"""Make the mem_agent example's documents (examples/mem_agent/data/): long texts whose answer needs two facts that
sit in different parts of the document, so a memory has to carry the first to where the second is read.

Each document is about lockers and their owners. The question is ``What is the code of NAME's locker?``; the
answer needs **two facts**, placed at about 1/4 and 3/4 of the document: ``NAME's locker is the COLOR one.`` and
``The COLOR locker's code is NNNN.`` Around them: the same two kinds of facts about other owners and colours
(distractors) and filler sentences, up to the document's length in words. With the example's 160-token chunks a
document of ``W`` words spans about ``W / 100`` chunks, so the two facts land in different chunks.

Files (seed 20261202): ``train.jsonl`` (256 documents of 200 words, 2-3 chunks), ``eval_200w.jsonl``,
``eval_400w.jsonl``, ``eval_800w.jsonl`` (32 documents each: evaluation at several document lengths). A row:
``{"prompt": [system, question], "label": "NNNN", "metadata": {"context": DOCUMENT, "words": W, "owner", "color"}}``.

    python examples/mem_agent/make_data.py [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 20261202
SYSTEM_PROMPT = "You read documents carefully and answer questions about them."
OWNERS = ["Mira", "Tomas", "Lena", "Oskar", "Nadia", "Pavel", "Rosa", "Ivan", "Elsa", "Karl", "Vera", "Leon"]
COLORS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple", "grey", "brown"]
FILLER = [
    "The hallway was quiet in the morning.",
    "A cleaner came by twice a week.",
    "The lights in the basement flickered now and then.",
    "Most people used the side entrance.",
    "The building was painted last spring.",
    "Someone had left an umbrella near the stairs.",
    "The lockers stood in a long row by the windows.",
    "Deliveries arrived before noon.",
    "The caretaker kept a list of repairs.",
    "On Fridays the canteen served soup.",
    "A notice asked everyone to close the doors.",
    "The old clock on the wall was five minutes slow.",
]


def document(rng: random.Random, words: int) -> dict:
    """One document of about ``words`` words with its question facts at ~1/4 and ~3/4, distractors and filler."""
    owners = rng.sample(OWNERS, 4)
    colors = rng.sample(COLORS, 4)
    codes = [f"{rng.randint(1000, 9999)}" for _ in owners]
    owner, color, code = owners[0], colors[0], codes[0]
    facts_a = [f"{o}'s locker is the {c} one." for o, c in zip(owners, colors, strict=True)]
    facts_b = [f"The {c} locker's code is {k}." for c, k in zip(colors, codes, strict=True)]
    sentences: list[str] = []
    while sum(len(s.split()) for s in sentences) < words:
        sentences.append(rng.choice(FILLER))
    n = len(sentences)
    # the two facts the answer needs, far apart; the distractors anywhere else
    sentences.insert(3 * n // 4, facts_b[0])
    sentences.insert(n // 4, facts_a[0])
    for fact in facts_a[1:] + facts_b[1:]:
        sentences.insert(rng.randrange(len(sentences) + 1), fact)
    return {
        "prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"What is the code of {owner}'s locker?"},
        ],
        "label": code,
        "metadata": {"context": " ".join(sentences), "words": words, "owner": owner, "color": color},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "data")
    args = parser.parse_args()
    rng = random.Random(SEED)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    sets = (("train", 256, 200), ("eval_200w", 32, 200), ("eval_400w", 32, 400), ("eval_800w", 32, 800))
    for name, n, words in sets:
        rows = [document(rng, words) for _ in range(n)]
        path = args.out_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{name}: {n} documents of ~{words} words -> {path}")


if __name__ == "__main__":
    main()
