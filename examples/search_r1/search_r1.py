"""Search-R1 on vime: retrieval as a tool over a local BM25 index, through the built-in ``multi_turn`` loop.

The model searches by writing ``<search>QUERY</search>``; the loop runs :func:`search` (BM25 over
``data/corpus.jsonl`` with `bm25s <https://github.com/xhluo/bm25s>`_, ``pip install "vime[examples]"``) and puts the
top passages back as ``<information>…</information>`` (context tokens, mask 0); the model answers with
``<answer>ANSWER</answer>``, scored by :func:`answer_exact_match`. Everything here is plain vime plugin surface::

    generate: multi_turn
    multi_turn_tools: [search_r1:search]               # this module, on PYTHONPATH
    multi_turn_tool_parser: search_r1:SearchR1Parser   # <search>…</search> calls, <information> results
    reward: search_r1:answer_exact_match

Format and reward after Search-R1 (Jin et al. 2025, arXiv:2503.09516, ``search_r1/search/retrieval_server.py`` and
``qa_em.py``): ``<search>`` / ``<information>`` / ``<answer>`` tags, exact match after SQuAD normalisation.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any

from vime_core.agent.tool_parsers import ParseResult, ToolCall, ToolParser
from vime_core.config.context import PluginContext
from vime_core.rewards.simple import normalize_answer
from vime_core.types import Sample

#: the corpus searched by default (``make_data.py`` writes it); ``SEARCH_R1_CORPUS`` names another JSONL file of
#: ``{"id", "title", "text"}`` rows
CORPUS = Path(__file__).resolve().parent / "data" / "corpus.jsonl"
#: passages returned per search (Search-R1's default ``topk`` is 3; the corpus here has one passage per entity)
TOP_K = 2

_SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class BM25Index:
    """A BM25 index of a corpus of passages (Robertson & Zaragoza 2009; `bm25s`'s Lucene variant, k1 = 1.5,
    b = 0.75), English stop words removed, no stemming.

    :param passages: ``[{"id", "title", "text"}]``; a passage is indexed as ``"title text"``.
    :raises ValueError: if ``passages`` is empty or a passage lacks ``title`` or ``text``.
    """

    def __init__(self, passages: list[dict[str, Any]]) -> None:
        import bm25s

        if not passages:
            raise ValueError("BM25Index: no passages")
        for i, p in enumerate(passages):
            missing = [k for k in ("title", "text") if not isinstance(p.get(k), str)]
            if missing:
                raise ValueError(f"BM25Index: passage {i} lacks {missing} (expected strings)")
        self.passages = passages
        self.retriever = bm25s.BM25()
        docs = [f"{p['title']} {p['text']}" for p in passages]
        self.retriever.index(bm25s.tokenize(docs, stopwords="en", show_progress=False), show_progress=False)

    @classmethod
    def from_jsonl(cls, path: Path) -> BM25Index:
        """Index the ``{"id", "title", "text"}`` rows of ``path``.

        :raises FileNotFoundError: naming the file and how to make it.
        :raises ValueError: naming the file and line of a row that is not such an object.
        """
        if not path.is_file():
            raise FileNotFoundError(f"search corpus {path} not found (python examples/search_r1/make_data.py)")
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from None
            if not isinstance(rows[-1], dict):
                raise ValueError(f"{path}:{n}: expected an object with title and text")
        return cls(rows)

    def search(self, query: str, k: int = TOP_K) -> list[tuple[dict[str, Any], float]]:
        """The ``k`` best passages for ``query`` with their BM25 scores, best first (fewer when the corpus is
        smaller); passages that share no term with the query score 0 and are left out."""
        import bm25s

        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not tokens.vocab:  # nothing left after stop words
            return []
        k = min(k, len(self.passages))
        ids, scores = self.retriever.retrieve(tokens, k=k, show_progress=False)
        return [(self.passages[int(i)], float(s)) for i, s in zip(ids[0], scores[0], strict=True) if s > 0]


@functools.lru_cache(maxsize=4)
def load_index(path: str) -> BM25Index:
    """The index of the corpus at ``path``, built once per process."""
    return BM25Index.from_jsonl(Path(path))


def format_passages(hits: list[tuple[dict[str, Any], float]]) -> str:
    """Search-R1's passage format: ``Doc i(Title: T) text`` per hit, one per line; ``No results.`` when none."""
    if not hits:
        return "No results."
    return "\n".join(f"Doc {i}(Title: {p['title']}) {p['text']}" for i, (p, _) in enumerate(hits, 1))


def search(query: str) -> str:
    """Search the encyclopedia; returns the best matching passages."""
    return format_passages(load_index(os.environ.get("SEARCH_R1_CORPUS", str(CORPUS))).search(query))


class SearchR1Parser(ToolParser):
    """Search-R1's tags as a tool-call format: each ``<search>QUERY</search>`` in a turn is a call
    ``search(query=QUERY)`` (stripped); results come back as ``<information>…</information>``. A ``<search>``
    without its closing tag makes the turn ill-formed (reason ``unclosed``); a turn without ``<search>`` (e.g. the
    ``<answer>``) has no call and ends the episode."""

    name = "search_r1"

    def parse(self, text: str) -> ParseResult:
        calls = [ToolCall("search", {"query": q.strip()}) for q in _SEARCH.findall(text)]
        rest = _SEARCH.sub("", text)
        if "<search>" in rest:
            return ParseResult(text, calls, True, ["<search> without </search>"], ["unclosed"])
        return ParseResult(rest.strip() if calls else text, calls)

    def format_calls(self, calls: list[ToolCall]) -> str:
        return "".join(f"<search>{c.arguments['query']}</search>" for c in calls)

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        return (
            "To look something up, write <search>your query</search>; the results come back between "
            "<information> and </information>. Search as often as you need, then give the final answer as "
            "<answer>ANSWER</answer>."
        )

    def format_results(self, results: list[str]) -> str:
        return "\n".join(f"<information>{r}</information>" for r in results)

    def call_prefix(self, name: str) -> str:
        return "<search>"

    def call_suffix(self) -> str:
        return "</search>"


def extract_answer(text: str) -> str | None:
    """The content of the last ``<answer>…</answer>`` in ``text``, or None."""
    found = _ANSWER.findall(text or "")
    return found[-1] if found else None


async def answer_exact_match(ctx: PluginContext, sample: Sample) -> float:
    """1.0 when the last ``<answer>`` of the episode equals the label after SQuAD normalisation (lower case, no
    punctuation or articles, single spaces), else 0.0 (also without an answer).

    :raises ValueError: a sample without a label (a row of the wrong data).
    """
    if sample.label is None or str(sample.label) == "":
        raise ValueError(f"search_r1: sample {sample.group_index}/{sample.index} has no label to match")
    answer = extract_answer(sample.response)
    return float(answer is not None and normalize_answer(answer) == normalize_answer(str(sample.label)))
