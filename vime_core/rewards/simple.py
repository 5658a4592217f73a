"""Text rewards for short answers: ``exact_match`` and token ``f1``, sharing SQuAD's answer normalisation.

Source: the SQuAD v1.1 evaluation script (Rajpurkar et al., 2016, ``normalize_answer`` / ``f1_score`` /
``exact_match_score``), the normalisation slime's and verl's ``f1``/QA rewards use. A label may be one answer or a
list of acceptable answers; the best-matching one counts (SQuAD's max over ground truths). A reasoning model's
thinking block is not part of its answer: both rewards read the response after :func:`strip_thinking`.
"""

from __future__ import annotations

import collections
import re
import string
import unicodedata
from typing import Any

from vime_core.config.context import PluginContext, takes_context
from vime_core.types import Sample

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_DECIMAL_POINT = re.compile(r"(?<=\d)\.(?=\d)")
_MINUS_SIGN = re.compile(r"(?<!\w)[-\u2212](?=\d)")
_KEPT_POINT, _KEPT_MINUS = "\x00", "\x01"


def strip_thinking(text: str) -> str:
    """``text`` after its last ``</think>``; ``""`` when a ``<think>`` is never closed; else ``text`` unchanged.
    Shared by every built-in answer reward: an answer written while thinking does not count."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        return ""
    return text


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: Unicode NFKC, lower case, punctuation (ASCII and Unicode) removed, the articles
    a/an/the removed, whitespace collapsed to single spaces (``" The  Eiffel-Tower. "`` → ``"eiffeltower"``).

    One deliberate difference from SQuAD's script: numbers keep their meaning. A decimal point between digits is
    kept (``"3.5"`` stays ``"3.5"``, not ``"35"``), so is a minus sign before a number (``"-3"`` and ``"−3"``, with
    U+2212, both give ``"-3"``, not ``"3"``), and a thousands separator is dropped (``"1,000"`` → ``"1000"``).
    """
    text = unicodedata.normalize("NFKC", text).lower()
    text = _MINUS_SIGN.sub(_KEPT_MINUS, _DECIMAL_POINT.sub(_KEPT_POINT, _THOUSANDS.sub("", text)))
    text = "".join(ch for ch in text if ch not in _PUNCT and unicodedata.category(ch)[0] != "P")
    text = _ARTICLES.sub(" ", text).replace(_KEPT_POINT, ".").replace(_KEPT_MINUS, "-")
    return " ".join(text.split())


def token_f1(prediction: str, gold: str) -> float:
    """Token-level F1 of two answers after :func:`normalize_answer` (SQuAD): ``2PR/(P+R)`` over the multiset of
    shared tokens; 1.0 when both normalise to nothing, 0.0 when only one does or nothing is shared."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def _golds(sample: Sample, name: str) -> list[str]:
    label: Any = sample.label
    if label is None:
        raise ValueError(f"{name}: sample {sample.group_index}/{sample.index} has no label (--label-key)")
    golds = [str(x) for x in label] if isinstance(label, (list, tuple)) else [str(label)]
    if not golds:
        raise ValueError(f"{name}: sample {sample.group_index}/{sample.index} has an empty list of labels")
    return golds


@takes_context
async def exact_match(ctx: PluginContext, sample: Sample) -> float:
    """1.0 if the response equals the label (or one of a list of labels) after :func:`normalize_answer`, else 0.0.

    :raises ValueError: if the sample has no label.
    """
    pred = normalize_answer(strip_thinking(sample.response))
    return float(any(pred == normalize_answer(g) for g in _golds(sample, "exact_match")))


@takes_context
async def f1(ctx: PluginContext, sample: Sample) -> float:
    """Token F1 (:func:`token_f1`) of the response against the label; the best over a list of labels. In [0, 1].

    :raises ValueError: if the sample has no label.
    """
    response = strip_thinking(sample.response)
    return max(token_f1(response, g) for g in _golds(sample, "f1"))
