"""Make the search_r1 example's data (examples/search_r1/data/): a corpus of made-up towns and questions about them.

Every town is invented (names from random syllables, seed 20261201), so the model cannot know the answers: it has to
search. ``corpus.jsonl`` holds one passage per town (``{"id", "title", "text"}``: the kingdom it is in, its river,
the year it was founded, its mayor); ``train.jsonl`` and ``eval.jsonl`` hold questions about disjoint towns, each a
prompt of a system line, two worked examples (a ``<search>`` call, its ``<information>``, the ``<answer>``) and the
question, with the answer as label.

    python examples/search_r1/make_data.py [--out-dir DIR] [--towns 240] [--eval-towns 40]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 20261201
SYSTEM_PROMPT = (
    "Answer the question about the town. You do not know these towns: search for the town first, then reply "
    "with <answer>ANSWER</answer> using the information you found."
)
ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kr", "tr", "st"]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
CODAS = ["", "", "n", "r", "l", "s", "th", "m"]
FIRST_NAMES = ["Ada", "Boris", "Clara", "Dmitri", "Elin", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira", "Lev"]
QUESTIONS = {
    "kingdom": "In which kingdom is the town of {town}?",
    "river": "On which river lies the town of {town}?",
    "founded": "In what year was the town of {town} founded?",
    "mayor": "Who is the mayor of the town of {town}?",
}


def word(rng: random.Random, syllables: int) -> str:
    """A made-up capitalised word of ``syllables`` onset-vowel-coda syllables."""
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables)).title()


def make_towns(n: int, rng: random.Random) -> list[dict]:
    """``n`` towns with distinct names; 8 kingdoms and 12 rivers shared among them."""
    kingdoms = sorted({word(rng, 2) for _ in range(8)})
    rivers = sorted({word(rng, 1) for _ in range(12)})
    names: set[str] = set()
    towns = []
    while len(towns) < n:
        name = word(rng, 3)
        if name in names or name in kingdoms or name in rivers:
            continue
        names.add(name)
        towns.append(
            {
                "town": name,
                "kingdom": rng.choice(kingdoms),
                "river": rng.choice(rivers),
                "founded": str(rng.randint(1100, 1899)),
                "mayor": f"{rng.choice(FIRST_NAMES)} {word(rng, 2)}",
            }
        )
    return towns


def passage(t: dict, i: int) -> dict:
    """The corpus row of town ``t``."""
    text = (
        f"{t['town']} is a town in the kingdom of {t['kingdom']}, on the river {t['river']}. "
        f"It was founded in {t['founded']}, and its mayor is {t['mayor']}."
    )
    return {"id": f"town-{i:04d}", "title": t["town"], "text": text}


def worked_example(t: dict, i: int, attribute: str) -> list[dict]:
    """One worked example as chat turns: the question, a ``search`` call, its result, the answer."""
    call = {"id": "call_0", "type": "function", "function": {"name": "search", "arguments": json.dumps(
        {"query": t["town"]})}}  # fmt: skip
    p = passage(t, i)
    info = f"Doc 1(Title: {p['title']}) {p['text']}"
    return [
        {"role": "user", "content": QUESTIONS[attribute].format(town=t["town"])},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": info},
        {"role": "assistant", "content": f"<answer>{t[attribute]}</answer>"},
    ]


def rows(towns: list[dict], offset: int, shots: list[dict], rng: random.Random) -> list[dict]:
    """One question per town (attribute drawn at random), with the worked examples before it."""
    out = []
    for j, t in enumerate(towns):
        attribute = rng.choice(sorted(QUESTIONS))
        question = {"role": "user", "content": QUESTIONS[attribute].format(town=t["town"])}
        out.append(
            {
                "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, *shots, question],
                "label": t[attribute],
                "metadata": {"town": t["town"], "attribute": attribute, "doc_id": f"town-{offset + j:04d}"},
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "data")
    parser.add_argument("--towns", type=int, default=240, help="towns in the corpus (2 are the worked examples)")
    parser.add_argument("--eval-towns", type=int, default=40, help="towns asked about in eval.jsonl only")
    args = parser.parse_args()
    rng = random.Random(SEED)
    towns = make_towns(args.towns, rng)
    corpus = [passage(t, i) for i, t in enumerate(towns)]
    shots = worked_example(towns[0], 0, "kingdom") + worked_example(towns[1], 1, "founded")
    n_train = args.towns - 2 - args.eval_towns
    train = rows(towns[2 : 2 + n_train], 2, shots, rng)
    evals = rows(towns[2 + n_train :], 2 + n_train, shots, rng)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, data in (("corpus", corpus), ("train", train), ("eval", evals)):
        path = args.out_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in data))
        print(f"{name}: {len(data)} rows -> {path}")


if __name__ == "__main__":
    main()
