"""The examples' configs parse, their local modules load, and their helpers compute exact values (no engine).

The examples' generate functions run against the real engine in tests/integration/test_examples_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from vime_core.arguments import parse_run_args
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("fully_async", {"loop": "fully-async", "max_staleness": 1, "train_cpus": "1", "rollout_cpu_bind": ["0"]}),
        ("multi_agent", {"generate": "solver_verifier:generate", "reward": "solver_verifier:team_reward"}),
        (
            "tool_use",
            {"generate": "multi_turn", "multi_turn_tools": ["number_tools", "vime_core.rollout.tools:calculator"]},
        ),
    ],
)
def test_example_config_parses(name, expected):
    args = parse_run_args(["--config", str(EXAMPLES / name / "config.yaml")])
    assert {k: getattr(args, k) for k in expected} == expected
    assert args.prompt_data.exists()
    first = json.loads(args.prompt_data.read_text().splitlines()[0])
    assert first["metadata"]["task"] and first["metadata"]["rg_entry"]["answer"] == first["label"]


def test_tool_use_tools(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES / "tool_use"))
    from vime_core.rollout.tools import load_tools

    tools = {t.name: t for t in load_tools(["number_tools", "vime_core.rollout.tools:calculator"])}
    assert sorted(tools) == ["calculator", "gcd", "lcm"]
    assert asyncio.run(tools["lcm"].call({"a": 12, "b": 18})) == "36"
    assert asyncio.run(tools["gcd"].call({"a": "84", "b": 36})) == "12"
    assert tools["lcm"].schema()["parameters"]["required"] == ["a", "b"]


def test_multi_agent_verdict_and_team_reward(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES / "multi_agent"))
    import solver_verifier as sv

    assert sv.parse_verdict("Verdict: Incorrect.") == "incorrect"
    assert sv.parse_verdict("I think verdict:correct") == "correct"
    assert sv.parse_verdict("Answer: 3") is None
    assert sv.parse_verdict("The proposed answer is indeed incorrect. While 9 + 2 is right") == "incorrect"
    assert sv.parse_verdict("No, the proposed answer is not correct") == "incorrect"
    assert sv.parse_verdict("That is right.") == "correct"
    row = json.loads((EXAMPLES / "quickstart" / "data" / "train.jsonl").read_text().splitlines()[0])
    right, wrong = row["label"], str(int(row["label"]) + 1)
    s = Sample(prompt=row["prompt"], metadata=dict(row["metadata"]), response=f"Answer: {wrong}")
    s.metadata["final_response"] = f"Answer: {right}"  # the revision was right: the team reward follows it
    assert asyncio.run(sv.team_reward(plugin_context(), s)) == 1.0
    s.metadata["final_response"] = f"Answer: {wrong}"
    assert asyncio.run(sv.team_reward(plugin_context(), s)) == 0.0


# -- the examples of issue 39: configs ------------------------------------------------------------------------------
NEW_EXAMPLES = {
    "mem_agent": {"generate": "mem_agent:generate", "reward": "mem_agent:reward"},
    "tau_bench": {"generate": "tau_agent:generate", "reward": "tau_agent:reward", "agent_history": "model"},
    "search_r1": {
        "generate": "multi_turn",
        "multi_turn_tools": ["search_r1:search"],
        "multi_turn_tool_parser": "search_r1:SearchR1Parser",
    },
    "retool": {"generate": "retool:generate", "multi_turn_tools": ["retool:code_interpreter"], "sandbox": "local"},
    "multi_task_eval": {"eval_set_reward": {"boxed": "math", "copy": "exact_match"}, "eval_interval": 2},
    "delta_weight_sync": {"weight_sync": "disk-delta", "update_weight_delta_encoding": "sub"},
    "on_policy_distillation": {
        "advantage_estimator": "on_policy_distill",
        "distill_teacher": "outputs/quickstart/final_hf",
    },
}


@pytest.mark.parametrize("name", sorted(NEW_EXAMPLES))
def test_new_example_configs_parse_and_their_plugins_resolve(name, monkeypatch):
    """Each config parses, its data files exist, and every plugin it names (dotted paths into the example's folder,
    tool-call parsers, per-set eval rewards) resolves, as `vime run` checks before anything starts."""
    from vime_core.agent.tool_parsers import get_tool_parser
    from vime_core.config import RunConfig
    from vime_core.plugins import get_plugins
    from vime_core.rollout.tools import load_tools
    from vime_core.run_checks import resolve_plugins

    monkeypatch.syspath_prepend(str(EXAMPLES / name))
    args = parse_run_args(["--config", str(EXAMPLES / name / "config.yaml")])
    assert {k: getattr(args, k) for k in NEW_EXAMPLES[name]} == NEW_EXAMPLES[name]
    assert args.model == "smollm2-135m-instruct" and args.prompt_data.is_file()
    assert all(Path(p).is_file() for p in (args.eval_prompt_data or [])[1::2])
    resolve_plugins(get_plugins(), RunConfig.from_args(args))
    if args.generate in ("multi_turn", "retool:generate"):
        assert [t.name for t in load_tools(args.multi_turn_tools)] == [args.multi_turn_tools[0].split(":")[1]]
        get_tool_parser(args.multi_turn_tool_parser)


# -- search_r1 --------------------------------------------------------------------------------------------------------
CORPUS = [
    {"id": "a", "title": "Velmora", "text": "Velmora is a town in the kingdom of Ostria, on the river Kell."},
    {"id": "b", "title": "Dunhaven", "text": "Dunhaven is a town in the kingdom of Brask, on the river Kell."},
    {"id": "c", "title": "Orlen", "text": "Orlen lies on the river Tamis; it was founded in 1432."},
]


def test_search_r1_bm25_retrieval_on_a_fixed_corpus(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(EXAMPLES / "search_r1"))
    import search_r1 as sr

    index = sr.BM25Index(CORPUS)
    hits = index.search("Which kingdom is Velmora in?")
    assert [p["id"] for p, _ in hits] == ["a", "b"]  # "Velmora" only in a; "kingdom" in a and b
    assert hits[0][1] > hits[1][1] > 0
    assert [p["id"] for p, _ in index.search("Kell Brask")] == ["b", "a"]  # b has both terms, a only "Kell"
    assert [p["id"] for p, _ in index.search("river Tamis founded", k=1)] == ["c"]
    assert index.search("the of in") == []  # stop words only
    assert index.search("zzz unknown") == []  # no shared term: left out
    assert sr.format_passages(hits[:1]) == (
        "Doc 1(Title: Velmora) Velmora is a town in the kingdom of Ostria, on the river Kell."
    )
    assert sr.format_passages([]) == "No results."
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(p) + "\n" for p in CORPUS))
    monkeypatch.setenv("SEARCH_R1_CORPUS", str(corpus))
    assert sr.search("Orlen") == "Doc 1(Title: Orlen) Orlen lies on the river Tamis; it was founded in 1432."
    (tmp_path / "bad.jsonl").write_text('{"title": "x", "text": "y"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not JSON"):
        sr.BM25Index.from_jsonl(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match=r"passage 0 lacks \['text'\]"):
        sr.BM25Index([{"title": "x"}])
    # the shipped corpus: each town's own passage is the best hit for its name
    rows = [json.loads(line) for line in (EXAMPLES / "search_r1" / "data" / "eval.jsonl").read_text().splitlines()]
    shipped = sr.load_index(str(sr.CORPUS))
    assert all(shipped.search(r["metadata"]["town"])[0][0]["id"] == r["metadata"]["doc_id"] for r in rows)


def test_search_r1_parser_and_reward(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES / "search_r1"))
    import search_r1 as sr

    p = sr.SearchR1Parser()
    r = p.parse("Let me look. <search> Velmora kingdom </search>")
    assert (r.content, [(c.name, c.arguments) for c in r.tool_calls], r.ill_formed) == (
        "Let me look.",
        [("search", {"query": "Velmora kingdom"})],
        False,
    )
    r = p.parse("<search>a</search><search>b</search>")
    assert [c.arguments["query"] for c in r.tool_calls] == ["a", "b"]
    r = p.parse("<answer>Ostria</answer>")
    assert (r.content, r.tool_calls, r.ill_formed) == ("<answer>Ostria</answer>", [], False)
    r = p.parse("<search>Velmora")
    assert (r.tool_calls, r.ill_formed, r.failure_counts()) == ([], True, {"unclosed": 1})
    assert p.format_calls(p.parse("<search>x y</search>").tool_calls) == "<search>x y</search>"
    assert p.format_results(["one", "two"]) == "<information>one</information>\n<information>two</information>"
    assert sr.extract_answer("<answer>a</answer> then <answer> The Ostria. </answer>") == " The Ostria. "
    ctx = plugin_context()
    s = Sample(response="<search>v</search><answer>the ostria</answer>", label="Ostria")
    assert asyncio.run(sr.answer_exact_match(ctx, s)) == 1.0  # SQuAD normalisation: case, article
    s.response = "Ostria"  # no <answer> tag
    assert asyncio.run(sr.answer_exact_match(ctx, s)) == 0.0
    with pytest.raises(ValueError, match="has no label"):
        asyncio.run(sr.answer_exact_match(ctx, Sample(response="<answer>x</answer>")))


# -- retool -----------------------------------------------------------------------------------------------------------
def test_retool_tool_output_and_its_sandbox(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES / "retool"))
    import retool

    assert retool.format_result(0, "99626\n", "", False) == "99626"
    assert retool.format_result(0, "", "", False) == "(no output)"
    assert retool.format_result(1, "", "Traceback ...\nNameError: x\n", False) == (
        "Traceback ...\nNameError: x\nexit code 1"
    )
    assert retool.format_result(137, "partial\n", "", True) == "partial\nError: timed out after 10 s"
    long = retool.format_result(0, "x" * 3000, "", False)
    assert long == "x" * 2000 + "\n[output truncated]"
    with pytest.raises(RuntimeError, match="runs inside retool:generate"):
        asyncio.run(retool.code_interpreter("print(1)"))
