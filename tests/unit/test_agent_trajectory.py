"""The trajectory manager (vime_core/agent/trajectory.py) on hand-written token ids: CLEAN / REALIGN / FORK, the
truncated/ill-formed rule, segment choice, shared episode ids, incremental prompt building — exact values."""

from __future__ import annotations

import pytest

from vime_core.agent.trajectory import (
    Drift,
    Trajectory,
    TurnRecord,
    check_token_exact,
    common_prefix_len,
)
from vime_core.types import Sample, Status

pytestmark = pytest.mark.unit

EOS = 2


def turn(prompt, out, finish="stop", lp=-0.5, version=3, **kw) -> TurnRecord:
    return TurnRecord(list(prompt), list(out), [lp] * len(out), [version] * len(out), finish, **kw)


def base() -> Sample:
    return Sample(group_index=4, index=1, prompt="task", label="42", metadata={"task": "t"})


def test_common_prefix_len():
    a = list(range(1000))
    assert common_prefix_len(a, a) == 1000
    assert common_prefix_len(a, a[:10]) == 10
    b = a[:700] + [-1] + a[701:]
    assert common_prefix_len(a, b) == 700
    assert common_prefix_len(a, b, start=650) == 700
    assert common_prefix_len([], [1]) == 0


def test_clean_extension_masks_context_and_trains_outputs():
    t = Trajectory()
    t1 = turn([1, 2, 3], [10, 11, EOS], lp=-0.25, version=3)
    t2 = turn([1, 2, 3, 10, 11, EOS, 5, 6], [12, EOS], lp=-0.75, version=4)
    assert t.record(t1).kind is Drift.NEW
    p = t.record(t2)
    assert (p.kind, p.segment, p.common_prefix, p.dropped_trainable, p.context_tokens) == (Drift.CLEAN, 0, 6, 0, 2)
    (s,) = t.to_samples(base(), reward=1.0, episode_id="ep-1")
    assert s.tokens == [1, 2, 3, 10, 11, EOS, 5, 6, 12, EOS]
    assert s.prompt_length == 3 and s.response_length == 7
    assert s.loss_mask == [1, 1, 1, 0, 0, 1, 1]
    assert s.rollout_log_probs == [-0.25, -0.25, -0.25, 0.0, 0.0, -0.75, -0.75]
    assert s.weight_versions == [3, 3, 3, 4, 4, 4, 4]  # context carries the version of the call that read it
    assert (s.status, s.reward, s.episode_id, s.remove_sample) == (Status.COMPLETED, 1.0, "ep-1", False)
    assert (s.group_index, s.index, s.prompt, s.label, s.metadata["task"]) == (4, 1, "task", "42", "t")
    assert s.metadata["trajectory"] == {
        "segment": 0,
        "num_segments": 1,
        "turns": [0, 1],
        "num_turns": 2,
        "drift": {"new": 1, "clean": 1, "realign": 0, "fork": 0},
        "realign_dropped_tokens": 0,
        "truncated_turns": [],
        "ill_formed_turns": [],
        "aborted_turns": [],
    }
    check_token_exact([s], [t1, t2])


def test_realign_cuts_at_the_divergence_and_drops_only_the_tail():
    """The re-sent history differs in the last two tokens of the previous output (e.g. stripped whitespace)."""
    t = Trajectory(max_realign_tokens=2)
    t1 = turn([1, 2, 3], [10, 11, 12, EOS])
    t2 = turn([1, 2, 3, 10, 11, 99, 5, 6], [20, EOS], lp=-1.0)
    t.record(t1)
    p = t.record(t2)
    assert (p.kind, p.common_prefix, p.dropped_trainable, p.context_tokens) == (Drift.REALIGN, 5, 2, 3)
    (s,) = t.to_samples(base())
    assert s.tokens == t2.prompt_ids + t2.output_ids == [1, 2, 3, 10, 11, 99, 5, 6, 20, EOS]
    assert s.loss_mask == [1, 1, 0, 0, 0, 1, 1]  # 10, 11 stay trained: they precede the divergence
    assert s.rollout_log_probs == [-0.5, -0.5, 0.0, 0.0, 0.0, -1.0, -1.0]
    assert s.metadata["trajectory"]["realign_dropped_tokens"] == 2
    assert s.metadata["trajectory"]["drift"]["realign"] == 1
    check_token_exact([s], [t1, t2])


def test_divergence_losing_more_than_the_bound_forks():
    t = Trajectory(max_realign_tokens=1)
    t1 = turn([1, 2, 3], [10, 11, 12, EOS])
    t2 = turn([1, 2, 3, 10, 11, 99, 5, 6], [20, EOS])
    t.record(t1)
    p = t.record(t2)
    assert (p.kind, p.segment, p.common_prefix) == (Drift.FORK, 1, 5)
    s0, s1 = t.to_samples(base(), reward=0.5)
    assert (s0.tokens, s0.prompt_length, s0.loss_mask) == ([1, 2, 3, 10, 11, 12, EOS], 3, [1, 1, 1, 1])
    assert (s1.tokens, s1.prompt_length, s1.loss_mask) == ([1, 2, 3, 10, 11, 99, 5, 6, 20, EOS], 8, [1, 1])
    assert s0.episode_id == s1.episode_id and s0.episode_id  # one episode: the loss counts it once
    assert s0.reward == s1.reward == 0.5
    assert [s.metadata["trajectory"]["segment"] for s in (s0, s1)] == [0, 1]
    assert s1.metadata["trajectory"]["drift"] == {"new": 0, "clean": 0, "realign": 0, "fork": 1}
    check_token_exact([s0, s1], [t1, t2])


def test_zero_realign_bound_forks_on_any_lost_trained_token_but_realigns_untrained_drift():
    """Bound 0: never lose a sampled token. Drift inside an untrained (ill-formed) output costs nothing: realign."""
    t1 = turn([1, 2, 3], [10, EOS])
    t2 = turn([1, 2, 3, 10, EOS, 5], [7, 7, EOS], ill_formed=True)  # e.g. a broken tool call, context only
    t3 = turn([1, 2, 3, 10, EOS, 5, 7, 9, EOS, 6], [11, EOS])  # the client re-sent it differently
    t = Trajectory(max_realign_tokens=0)
    t.record(t1)
    t.record(t2)
    p = t.record(t3)
    assert (p.kind, p.common_prefix, p.dropped_trainable, p.context_tokens) == (Drift.REALIGN, 7, 0, 3)
    (s,) = t.to_samples(base())
    assert s.tokens == t3.prompt_ids + t3.output_ids
    assert s.loss_mask == [1, 1, 0, 0, 0, 0, 0, 1, 1]
    t4 = turn([1, 2, 3, 10, 99, 5], [12, EOS])  # loses the trained EOS of turn 0
    p = t.record(t4)
    assert (p.kind, p.common_prefix) == (Drift.FORK, 4)
    check_token_exact(t.to_samples(base()), [t1, t2, t3, t4])


def test_divergence_in_the_first_prompt_forks():
    t = Trajectory(max_realign_tokens=100)
    t.record(turn([1, 2, 3], [10, EOS]))
    p = t.record(turn([1, 9, 3, 10, EOS, 5], [11, EOS]))
    assert (p.kind, p.segment, p.common_prefix) == (Drift.FORK, 1, 1)


def test_side_request_forks_and_the_main_conversation_continues_its_segment():
    """E.g. an agent CLI asking for a title with another system prompt between two main turns."""
    t = Trajectory()
    main1 = turn([1, 2, 3], [10, EOS])
    side = turn([7, 8], [30, EOS])
    main2 = turn([1, 2, 3, 10, EOS, 5], [11, EOS])
    assert [t.record(x).kind for x in (main1, side, main2)] == [Drift.NEW, Drift.FORK, Drift.CLEAN]
    s0, s1 = t.to_samples(base())
    assert s0.tokens == [1, 2, 3, 10, EOS, 5, 11, EOS] and s0.loss_mask == [1, 1, 0, 1, 1]
    assert s1.tokens == [7, 8, 30, EOS] and s1.loss_mask == [1, 1]
    assert s0.metadata["trajectory"]["turns"] == [0, 2] and s1.metadata["trajectory"]["turns"] == [1]


def test_truncated_and_ill_formed_turns_are_context_only():
    t = Trajectory()
    t1 = turn([1, 2], [10, 11], finish="length")
    t2 = turn([1, 2, 10, 11, EOS, 5], [12, 13, EOS], ill_formed=True)
    t3 = turn([1, 2, 10, 11, EOS, 5, 12, 13, EOS, 6], [14, EOS])
    for x in (t1, t2, t3):
        t.record(x)
    (s,) = t.to_samples(base())
    assert s.loss_mask == [0, 0, 0, 0, 0, 0, 0, 0, 1, 1]
    assert s.rollout_log_probs == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5, -0.5, 0.0, -0.5, -0.5]  # kept, not trained
    meta = s.metadata["trajectory"]
    assert (meta["truncated_turns"], meta["ill_formed_turns"]) == ([0], [1])
    assert s.status is Status.COMPLETED and s.is_trainable()
    check_token_exact([s], [t1, t2, t3])


def test_a_segment_with_nothing_trained_is_excluded():
    t = Trajectory()
    t.record(turn([1, 2], [10, 11], finish="length"))
    (s,) = t.to_samples(base())
    assert (s.status, s.remove_sample, s.loss_mask, s.is_trainable()) == (Status.TRUNCATED, True, [0, 0], False)
    assert "no trained token" in s.metadata["excluded"]
    t = Trajectory()
    t.record(turn([1, 2], [10, EOS], finish="abort"))
    (s,) = t.to_samples(base())
    assert s.remove_sample and s.metadata["trajectory"]["aborted_turns"] == [0]


def test_no_turns_no_samples_and_validation():
    assert Trajectory().to_samples(base()) == []
    with pytest.raises(ValueError, match="2 output ids, 1 log-probs"):
        Trajectory().record(TurnRecord([1], [2, 3], [-1.0], [0, 0], "stop"))
    with pytest.raises(ValueError, match="finish_reason"):
        Trajectory().record(TurnRecord([1], [2], [-1.0], [0], "eos"))
    with pytest.raises(ValueError, match="max_realign_tokens"):
        Trajectory(max_realign_tokens=-1)


def test_base_episode_id_is_kept():
    t = Trajectory()
    t.record(turn([1], [2]))
    b = base()
    b.episode_id = "group-4/1"
    assert t.to_samples(b)[0].episode_id == "group-4/1"


# -- incremental prompt building ------------------------------------------------------------------------------------
class CharTok:
    """A real (if trivial) tokenizer: one id per character, so the tests can count exactly what was tokenised."""

    def __init__(self) -> None:
        self.encoded_chars = 0

    def encode(self, text: str) -> list[int]:
        self.encoded_chars += len(text)
        return [ord(c) for c in text]

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def test_plan_tokenises_each_character_once_over_a_long_episode():
    tok = CharTok()
    t = Trajectory()
    text, new_chars = "<sys>task<gen>", 0
    for k in range(60):
        plan = t.plan(text, tok.encode, tok.decode)
        assert plan.prompt_ids == [ord(c) for c in text]  # what a full tokenisation would give
        out = f"answer {k}$"
        tr = TurnRecord(
            plan.prompt_ids,
            tok.encode(out),
            [-0.1] * len(out),
            [0] * len(out),
            "stop",
            prompt_text=text,
            output_text=out,
        )
        tok.encoded_chars -= len(out)  # the engine's output is not tokenised by the trajectory
        assert t.record(tr, plan).kind is (Drift.NEW if k == 0 else Drift.CLEAN)
        new = f"<tool>result {k}<gen>"
        new_chars += len(new)
        text = text + out + new
    first = len("<sys>task<gen>")
    assert t.tokenized_chars == tok.encoded_chars == first + new_chars - len(new)  # the last `new` was never sent
    (s,) = t.to_samples(base())
    assert s.tokens == [ord(c) for c in text[: -len(new)]]


def test_plan_keeps_the_model_tokens_up_to_a_divergence_inside_the_output():
    """The client strips trailing whitespace: the prompt reuses the output's ids up to the divergence, and the
    realign drops only the whitespace tokens."""
    tok = CharTok()
    t = Trajectory()
    p1 = "<u>hi<a>"
    plan = t.plan(p1, tok.encode, tok.decode)
    out_ids = [ord(c) for c in "ok  $"]  # '$' = end of turn
    t.record(
        TurnRecord(plan.prompt_ids, out_ids, [-0.2] * 5, [1] * 5, "stop", prompt_text=p1, output_text="ok  $"), plan
    )
    p2 = "<u>hi<a>ok$<u>more<a>"
    plan2 = t.plan(p2, tok.encode, tok.decode)
    assert plan2.segment == 0 and plan2.shared_len == len(p1) + 2  # "<u>hi<a>" + "ok"
    assert plan2.tokenized_chars == len("$<u>more<a>")
    tr = TurnRecord(
        plan2.prompt_ids, [ord("!"), ord("$")], [-0.3] * 2, [1] * 2, "stop", prompt_text=p2, output_text="!$"
    )
    p = t.record(tr, plan2)
    assert (p.kind, p.dropped_trainable) == (Drift.REALIGN, 3)
    (s,) = t.to_samples(base())
    assert tok.decode(s.tokens) == p2 + "!$"
    assert s.loss_mask == [1, 1] + [0] * len("$<u>more<a>") + [1, 1]


def test_plan_falls_back_to_full_tokenisation_when_a_suffix_does_not_round_trip():
    class LeadingSpace(CharTok):
        def encode(self, text: str) -> list[int]:  # a SentencePiece-like tokenizer that prefixes a space
            return super().encode(" " + text)[1:] if text.startswith(" ") else super().encode(" " + text)

    tok = LeadingSpace()
    t = Trajectory()
    plan = t.plan("ab", tok.encode, tok.decode)
    t.record(TurnRecord(plan.prompt_ids, [ord("c")], [-1.0], [0], "stop", prompt_text="ab", output_text="c"), plan)
    plan2 = t.plan("abcd", tok.encode, tok.decode)
    assert plan2.segment is None and plan2.prompt_ids == tok.encode("abcd")
