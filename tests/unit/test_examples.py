"""The examples' configs parse, their local modules load, and their helpers compute exact values (no engine).

The examples' generate functions run against the real engine in tests/integration/test_examples_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from vime_core.cli.arguments import parse_run_args
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample, Status

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
            {
                "generate": "multi_turn",
                "multi_turn_tools": ["number_tools", "vime_core.rollout.generators.tools:calculator"],
            },
        ),
        (
            "train_infer_mismatch",
            {
                "get_mismatch_metrics": True,
                "use_rollout_correction": True,
                "use_tis": True,
                "use_rs": True,
                "rs_level": "geometric",
                "rs_upper_bound": 1.05,
                "rs_veto_threshold": 1e-4,
            },
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
    from vime_core.rollout.generators.tools import load_tools

    tools = {t.name: t for t in load_tools(["number_tools", "vime_core.rollout.generators.tools:calculator"])}
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
    from vime_core.plugins.manager import get_plugins
    from vime_core.rollout.generators.tools import load_tools
    from vime_core.run.preflight import resolve_plugins

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


# -- mem_agent --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture
def scripted_engine(tok):
    """``make(script) -> ScriptedResponder`` installed as the rollout context's client (the engine generate functions
    call), the context cleared afterwards (and any agent gateway it started stopped)."""
    from vime_core.agent.responders import ScriptedResponder
    from vime_core.rollout.context import RolloutContext, set_rollout_context

    made = []

    def make(script):
        engine = ScriptedResponder(tok, script)
        made.append(RolloutContext(client=engine, tokenizer=tok, weight_version=0))
        set_rollout_context(made[-1])
        return engine

    yield make
    set_rollout_context(None)
    for c in made:
        if "agent_gateway" in c.extras:
            c.extras["agent_gateway"].stop()


def test_mem_agent_chunks_by_tokens(monkeypatch, tok):
    monkeypatch.syspath_prepend(str(EXAMPLES / "mem_agent"))
    import mem_agent

    text = "The red locker's code is 4817. " * 5
    ids = tok(text, add_special_tokens=False)["input_ids"]
    chunks = mem_agent.chunk_document(tok, text, 7)
    assert [tok(c, add_special_tokens=False)["input_ids"] for c in chunks] == [
        ids[i : i + 7] for i in range(0, len(ids), 7)
    ]
    assert "".join(chunks) == tok.decode(ids) and len(chunks) == -(-len(ids) // 7)
    with pytest.raises(ValueError, match="empty document"):
        mem_agent.chunk_document(tok, "", 7)
    monkeypatch.setenv("MEM_AGENT_CHUNK_TOKENS", "0")
    with pytest.raises(ValueError, match=r"MEM_AGENT_CHUNK_TOKENS='0': expected a positive number of tokens"):
        mem_agent._size("MEM_AGENT_CHUNK_TOKENS", 160)


def test_mem_agent_overwrites_memory_and_returns_one_sample_per_turn(monkeypatch, tok, scripted_engine):
    """Two chunks: the second memory turn sees the first turn's output as its memory (overwritten, not appended), the
    answer turn sees only the question and the last memory; every turn is its own sample, token-exact."""
    monkeypatch.syspath_prepend(str(EXAMPLES / "mem_agent"))
    import mem_agent

    from vime_core.rollout.generators.default import encode_prompt

    doc = "Mira's locker is the red one. " * 3 + "The red locker's code is 4817. " * 3
    size = (len(tok(doc, add_special_tokens=False)["input_ids"]) + 1) // 2
    chunks = mem_agent.chunk_document(tok, doc, size)
    assert len(chunks) == 2
    engine = scripted_engine(["Mira has the red locker.", "The red locker is Mira's; code 4817.", "Answer: 4817"])
    sample = Sample(
        group_index=2,
        index=1,
        prompt=[{"role": "user", "content": "What is the code of Mira's locker?"}],
        label="4817",
        metadata={"context": doc, "owner": "Mira"},
    )
    params = {"temperature": 1.0, "max_tokens": 64}
    turns = asyncio.run(mem_agent.generate(plugin_context(), sample, params, chunk_tokens=size, memory_tokens=40))
    q = "What is the code of Mira's locker?"
    expected = [
        mem_agent.memory_prompt(q, "No previous memory", chunks[0]),
        mem_agent.memory_prompt(q, "Mira has the red locker.", chunks[1]),
        mem_agent.answer_prompt(q, "The red locker is Mira's; code 4817."),
    ]
    assert [t.prompt for t in turns] == expected
    assert [c.prompt_ids for c in engine.calls] == [encode_prompt(tok, m, True) for m in expected]
    assert [c.sampling_params["max_tokens"] for c in engine.calls] == [40, 40, 16]  # memory, memory, answer caps
    for t, c in zip(turns, engine.calls, strict=True):
        t.validate()
        assert t.tokens == c.prompt_ids + c.output.token_ids  # its own prompt, nothing of the other turns
        assert t.loss_mask == [1] * len(c.output.token_ids) and t.rollout_log_probs == c.output.log_probs
        assert (t.group_index, t.index, t.label, t.status) == (2, 1, "4817", Status.COMPLETED)
        assert "context" not in t.metadata and t.metadata["owner"] == "Mira"
    assert [(t.metadata["mem_turn"], t.metadata["mem_role"]) for t in turns] == [
        (0, "memory"),
        (1, "memory"),
        (2, "answer"),
    ]
    assert [t.metadata["memory"] for t in turns] == [
        "Mira has the red locker.",
        "The red locker is Mira's; code 4817.",
        "The red locker is Mira's; code 4817.",
    ]
    assert {t.metadata["final_response"] for t in turns} == {"Answer: 4817"}
    assert {t.metadata["num_chunks"] for t in turns} == {2}


def test_mem_agent_group_reward_reaches_every_turn(monkeypatch, tok, scripted_engine):
    """Through the rollout manager's group runner: a group of two rollouts (one right, one wrong) is scored once per
    rollout; every turn carries its rollout's reward and episode id, and GRPO gives all turns of a rollout its
    advantage (±1/√2 for rewards 1 / 0)."""
    monkeypatch.syspath_prepend(str(EXAMPLES / "mem_agent"))
    import mem_agent

    from vime_core.builtins.advantages import grpo
    from vime_core.plugins.manager import get_plugins
    from vime_core.rollout.runner import GroupRunner

    doc = "Mira's locker is the red one. The red locker's code is 4817."  # one chunk at 160 tokens
    engine = scripted_engine(
        {"*": ["red locker, 4817", "Answer: 4817", "red locker", "Answer: 1234"]}  # rollout 0 right, rollout 1 wrong
    )
    ctx = plugin_context(rollout_concurrency=1)  # one rollout at a time: the script's order is the rollouts' order
    group = [
        Sample(
            group_index=0,
            index=i,
            prompt="What is the code of Mira's locker?",
            label="4817",
            metadata={"context": doc},
        )  # fmt: skip
        for i in range(2)
    ]
    runner = GroupRunner(ctx, mem_agent.generate, mem_agent.reward, get_plugins().pm.hook)
    asyncio.run(runner.run([group], step=0, params={"temperature": 1.0, "max_tokens": 48}))
    assert len(engine.calls) == 4 and len(group) == 4  # two turns per rollout, the segments in place of the samples
    assert [(s.index, s.metadata["mem_role"], s.reward) for s in group] == [
        (0, "memory", 1.0),
        (0, "answer", 1.0),
        (1, "memory", 0.0),
        (1, "answer", 0.0),
    ]
    assert group[0].episode_id == group[1].episode_id != group[2].episode_id == group[3].episode_id
    adv = grpo(plugin_context(), group)
    half = 0.5 / (0.5**0.5 + 1e-6)  # (r - mean) / (std + 1e-6) over the two rollouts' rewards 1, 0 (unbiased std)
    assert [a[0] for a in adv] == pytest.approx([half, half, -half, -half], abs=1e-12)
    assert all(len(set(a)) == 1 and len(a) == s.response_length for a, s in zip(adv, group, strict=True))
    ctx_sample = Sample(label="4817", metadata={"final_response": "I think...\nAnswer: the 4817."})
    assert asyncio.run(mem_agent.reward(plugin_context(), ctx_sample)) == 1.0
    with pytest.raises(ValueError, match="metadata.final_response missing"):
        asyncio.run(mem_agent.reward(plugin_context(), Sample(label="1")))


# -- tau_bench --------------------------------------------------------------------------------------------------------
def _tau_task(kind: str) -> dict:
    rows = [json.loads(x) for x in (EXAMPLES / "tau_bench" / "data" / "eval.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["metadata"]["task"]["task_id"].startswith(kind))


def test_tau_retail_state_transitions_and_reward(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES / "tau_bench"))
    import tau_retail as tr

    db = tr.load_db()
    row = _tau_task("return")
    task = tr.Task.from_metadata(row["metadata"])
    (goal,) = task.actions
    oid, (item,), gift = (goal["arguments"][k] for k in ("order_id", "item_ids", "payment_method_id"))
    order = db["orders"][oid]
    uid = order["user_id"]
    price = next(it["price"] for it in order["items"] if it["item_id"] == item)
    balance = db["users"][uid]["payment_methods"][gift]["balance"]
    env = tr.RetailEnv(db)
    assert env.find_user_id_by_email(db["users"][uid]["email"].upper()) == uid
    assert env.find_user_id_by_email("nobody@example.com") == "Error: user not found"
    assert json.loads(env.get_order_details(oid)) == order
    # refused actions leave the database as it was
    before = tr.db_hash(env.db)
    assert (
        env.cancel_pending_order(oid, "no longer needed")
        == f"Error: order {oid} is delivered, only pending orders can be cancelled"
    )
    assert env.return_delivered_order_items(oid, ["9999"], gift).startswith(f"Error: not items of order {oid}")
    assert env.step("return_delivered_order_items", {"order_id": oid}).startswith("Error: bad arguments")
    assert env.step("drop_database", {}) == f"Error: unknown tool 'drop_database'; available: {', '.join(env.TOOLS)}"
    assert tr.db_hash(env.db) == before
    # the goal action: status, returned items, refund onto the gift card
    result = env.step(goal["name"], goal["arguments"])
    assert json.loads(result) == {"order_id": oid, "status": "return requested", "refund": price}
    assert env.db["orders"][oid]["status"] == "return requested" and env.db["orders"][oid]["return_items"] == [item]
    assert env.db["users"][uid]["payment_methods"][gift]["balance"] == round(balance + price, 2)
    assert db["orders"][oid]["status"] == "delivered"  # the loaded database is untouched (deep copy)
    # step() logs every call (the direct method calls above are not logged)
    assert [a["name"] for a in env.actions] == ["return_delivered_order_items", "drop_database", goal["name"]]
    final = tr.db_hash(env.db)
    assert task.outputs == (f"{price:.2f}",)
    assert tr.task_reward(task, db, final, [f"Done! You get {price:.2f} back."]) == 1.0
    assert tr.task_reward(task, db, final, ["Done!"]) == 0.0  # the refund was not said
    assert tr.task_reward(task, db, before, [f"{price:.2f}"]) == 0.0  # the database is not the goal's
    cancel = tr.Task.from_metadata(_tau_task("cancel")["metadata"])
    env = tr.RetailEnv(db)
    coid = cancel.actions[0]["arguments"]["order_id"]
    assert env.cancel_pending_order(coid, "too expensive").startswith("Error: reason must be one of")
    env.step("cancel_pending_order", {"order_id": coid, "reason": "no longer needed"})
    assert env.db["orders"][coid]["status"] == "cancelled"
    assert tr.task_reward(cancel, db, tr.db_hash(env.db), []) == 1.0
    with pytest.raises(ValueError, match=r"metadata.task.user_turns missing or not a list"):
        tr.Task.from_metadata({"task": {"user_id": "u", "instruction": "i", "actions": []}})


def test_tau_episode_through_the_agent_gateway_is_token_exact(monkeypatch, tok, scripted_engine):
    """A cancel task played by a scripted policy through the real gateway (OpenAI Chat over HTTP, Hermes tool calls
    parsed by the gateway) against the scripted user: the database reaches the goal (reward 1.0), and the one
    trajectory segment is exactly the engine's last prompt + output, trained exactly on the engine's outputs."""
    monkeypatch.syspath_prepend(str(EXAMPLES / "tau_bench"))
    import tau_agent
    import tau_retail as tr

    from vime_core.agent.trajectory import TurnRecord, check_token_exact
    from vime_core.testing.samples import chain_mask

    row = _tau_task("cancel")
    task = row["metadata"]["task"]
    db = tr.load_db()
    email = db["users"][task["user_id"]]["email"]
    oid = task["actions"][0]["arguments"]["order_id"]

    def call(name, args):
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"

    engine = scripted_engine(
        [
            call("find_user_id_by_email", {"email": email}),
            call("cancel_pending_order", {"order_id": oid, "reason": "no longer needed"}),
            "Your order is cancelled.",
            "Done. Have a nice day!",
        ]
    )
    ctx = plugin_context(agent_max_turns=6, agent_max_tokens=96, agent_history="model")
    sample = Sample(group_index=1, index=3, prompt=row["prompt"], metadata=row["metadata"])
    monkeypatch.delenv("TAU_USER", raising=False)
    (s,) = asyncio.run(tau_agent.generate(ctx, sample, {"temperature": 1.0, "max_tokens": 96}))
    calls = engine.calls
    assert len(calls) == 4
    s.validate()
    assert (s.group_index, s.index, s.status) == (1, 3, Status.COMPLETED)
    assert s.tokens == calls[-1].prompt_ids + calls[-1].output.token_ids
    assert s.prompt_length == len(calls[0].prompt_ids)
    assert s.loss_mask == chain_mask(calls)
    turns = [
        TurnRecord(c.prompt_ids, c.output.token_ids, c.output.log_probs, [0] * len(c.output.token_ids), "stop")
        for c in calls
    ]
    check_token_exact([s], turns)
    # what the engine read between its turns: the tool results and the user's messages, as context
    between = [tok.decode(calls[i + 1].prompt_ids[len(calls[i].prompt_ids) + len(calls[i].output.token_ids) :])
               for i in range(3)]  # fmt: skip
    assert f"<tool_response>\n{task['user_id']}\n</tool_response>" in between[0]
    assert '"status": "cancelled"' in between[1] and task["user_turns"][1] in between[2]
    assert task["user_turns"][0] in tok.decode(calls[0].prompt_ids)
    tau = s.metadata["tau"]
    assert [(a["name"], a["result"]) for a in tau["actions"]][0] == ("find_user_id_by_email", task["user_id"])
    assert tau["end"] == "user_stop" and tau["user"] == "ScriptedUser"
    assert tau["agent_texts"] == ["Your order is cancelled.", "Done. Have a nice day!"]
    assert tau["db_hash"] == tr.Task.from_metadata(row["metadata"]).goal_hash(db)
    assert asyncio.run(tau_agent.reward(ctx, s)) == 1.0


def test_tau_user_simulators(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES / "tau_bench"))
    import tau_agent
    import tau_retail as tr

    task = tr.Task.from_metadata(_tau_task("cancel")["metadata"])
    user = tau_agent.ScriptedUser(task.user_turns)
    got = [asyncio.run(user.reply(m)) for m in (None, "ok?", "done", "bye")]
    assert got == [*task.user_turns, tau_agent.STOP, tau_agent.STOP]
    monkeypatch.setenv("TAU_USER", "llm")
    monkeypatch.delenv("TAU_USER_BASE_URL", raising=False)
    monkeypatch.setenv("TAU_USER_MODEL", "m")
    with pytest.raises(ValueError, match=r"^TAU_USER=llm needs TAU_USER_BASE_URL"):
        tau_agent.user_for(task)
    monkeypatch.setenv("TAU_USER_BASE_URL", "http://127.0.0.1:9/v1")
    llm = tau_agent.user_for(task)
    assert isinstance(llm, tau_agent.LLMUser) and llm.url == "http://127.0.0.1:9/v1/chat/completions"
    assert task.instruction in llm.messages[0]["content"]
    monkeypatch.setenv("TAU_USER", "human")
    with pytest.raises(ValueError, match=r"TAU_USER='human': expected 'scripted' or 'llm'"):
        tau_agent.user_for(task)


# -- delta_weight_sync, on_policy_distillation: what their scripts print ---------------------------------------------
def _metrics(tmp_path, records):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path


def test_delta_weight_sync_prints_bytes_per_sync_against_full(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(EXAMPLES / "delta_weight_sync"))
    import sync_bytes

    mib = 1 << 20
    out = _metrics(
        tmp_path,
        [
            {"step": 0, "eval/a/reward_mean": 0.5},
            {"step": 0, "weight_sync/bytes": 128 * mib, "weight_sync/full_bytes": 512 * mib},
            {"step": 1, "weight_sync/bytes": 64 * mib, "weight_sync/full_bytes": 512 * mib},
        ],
    )
    assert sync_bytes.format_table(sync_bytes.sync_table(out)) == (
        "step  written MiB   full MiB  written/full\n"
        "   1        128.0      512.0         25.0%\n"
        "   2         64.0      512.0         12.5%\n"
        " all        192.0     1024.0         18.8%"
    )
    _metrics(tmp_path, [{"step": 0, "weight_sync/bytes": 5.0}])
    with pytest.raises(ValueError, match="step 0 has no weight_sync/full_bytes: not a --weight-sync disk-delta run"):
        sync_bytes.sync_table(out)


def test_on_policy_distillation_prints_the_loss_per_step(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(EXAMPLES / "on_policy_distillation"))
    import distill_curve

    out = _metrics(
        tmp_path,
        [
            {"step": 0, "eval/arith/reward_mean": 0.4},
            {"step": 0, "rollout/distill_reverse_kl": 0.8125, "rollout/reward_mean": 0.25},
            {"step": 1, "rollout/distill_reverse_kl": 0.5, "rollout/reward_mean": 0.5},
        ],
    )
    assert distill_curve.format_curve(distill_curve.distill_curve(out)) == (
        "step  reverse KL (nats/token)  reward\n"
        "   1                   0.8125   0.250\n"
        "   2                   0.5000   0.500"
    )
    _metrics(tmp_path, [{"step": 0, "rollout/reward_mean": 0.5}])
    with pytest.raises(ValueError, match="step 0 has no rollout/distill_reverse_kl: no --distill-teacher"):
        distill_curve.distill_curve(out)
