"""Finish reasons and truncation: an answer that carries no finish reason is classified from its ids (EOS or a stop
token → stop, the budget spent → length, only the rest is an abort), and DAPO's overlong filter and soft overlong
punishment, with exact masks, rewards and metrics (single-turn, and multi_turn's stop reasons)."""

from __future__ import annotations

import pytest

from tests.support.rollout import manager_with_hooks
from vime_core.cli.arguments import ArgumentError, parse_run_args
from vime_core.engines.client import RouterClient, eos_token_ids, normalize_finish_reason
from vime_core.rollout.overlong import is_length_truncated, overlong_penalty
from vime_core.types import Sample, Status

pytestmark = pytest.mark.unit

BASE = ["--model", "m", "--prompt-data", "d.jsonl"]
EOS = 7


# ------------------------------------------------------------------------------------------------ finish reasons
def test_finish_reason_given_by_the_engine_is_kept():
    assert normalize_finish_reason("stop", [1, 2]) == "stop"
    assert normalize_finish_reason("length", [1, 2]) == "length"
    # a real abort stays an abort even if its last token happens to be EOS
    assert normalize_finish_reason("abort", [1, EOS], max_tokens=2, end_token_ids={EOS}) == "abort"


@pytest.mark.parametrize(
    ("reason", "ids", "max_tokens", "expected"),
    [
        (None, [4, 5, EOS], 16, "stop"),  # ends with EOS
        (None, [4, 5, 9], 16, "stop"),  # ends with a stop token (9)
        (None, [4, 5, 6, 8], 4, "length"),  # budget spent
        (None, [4, 5, EOS], 3, "stop"),  # EOS exactly at the budget: the model finished
        (None, [4, 5], 16, "abort"),  # neither finished nor cut: an abort
        (None, [], 16, "abort"),
        (None, [4, 5, 6], None, "abort"),  # budget unknown: no length derivation
        ("error", [4, EOS], 16, "stop"),  # a reason vime does not know is derived the same way
        ("repetition", [4, 5, 6, 8], 4, "length"),
    ],
)
def test_missing_finish_reason_is_derived_from_the_ids(reason, ids, max_tokens, expected):
    assert normalize_finish_reason(reason, ids, max_tokens=max_tokens, end_token_ids={EOS, 9}) == expected


def _choice(ids, reason):
    return {"token_ids": ids, "finish_reason": reason, "text": "t"}


def test_client_derives_the_reason_from_eos_stop_token_ids_and_max_tokens():
    client = RouterClient("http://127.0.0.1:9", "m", eos_token_ids=[EOS])
    lps = [-0.5, -0.25, -1.0]
    assert client._output(_choice([4, 5, EOS], None), lps, None, {"max_tokens": 16}).finish_reason == "stop"
    # a stop token of the request
    out = client._output(_choice([4, 5, 9], None), lps, None, {"max_tokens": 16, "stop_token_ids": [9]})
    assert (out.finish_reason, out.token_ids, out.log_probs) == ("stop", [4, 5, 9], lps)
    assert client._output(_choice([4, 5, 6], None), lps, None, {"max_tokens": 3}).finish_reason == "length"
    assert client._output(_choice([4, 5, 6], None), lps, None, {"max_tokens": 16}).finish_reason == "abort"
    # with ignore_eos the EOS id does not end a response
    assert client._output(
        _choice([4, 5, EOS], None), lps, None, {"max_tokens": 16, "ignore_eos": True}
    ).finish_reason == ("abort")
    assert client._output(_choice([4, 5, EOS], "abort"), lps, None, {"max_tokens": 3}).finish_reason == "abort"


def test_eos_token_ids_from_tokenizer_and_generation_config(tiny_model_dir, tmp_path):
    import json
    import shutil

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert eos_token_ids(tok, tiny_model_dir) == [im_end]
    assert eos_token_ids(tok) == [im_end]
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, 3, 5]}))
    assert eos_token_ids(tok, model) == sorted({im_end, 3, 5})


# ---------------------------------------------------------------------------------------------- overlong rules
def test_overlong_penalty_is_linear_in_the_overflow():
    # L_max 8, L_cache 4: 0 up to 4 tokens, then -1/4 per token down to -1 at 8 tokens
    assert [overlong_penalty(n, 8, 4, 1.0) for n in range(9)] == [0.0] * 5 + [-0.25, -0.5, -0.75, -1.0]
    assert [overlong_penalty(n, 8, 4, 0.5) for n in (4, 5, 6, 8)] == [0.0, -0.125, -0.25, -0.5]
    assert overlong_penalty(10, 10, 10, 2.0) == -2.0 and overlong_penalty(0, 10, 10, 2.0) == 0.0


def test_length_truncated_is_the_token_budget_not_the_turn_cap():
    def s(status, stop_reason=None):
        return Sample(status=status, metadata={} if stop_reason is None else {"stop_reason": stop_reason})

    assert is_length_truncated(s(Status.TRUNCATED))  # default generate: finish reason length / no budget left
    assert is_length_truncated(s(Status.TRUNCATED, "length"))  # multi_turn: the engine stopped on length
    assert is_length_truncated(s(Status.TRUNCATED, "budget"))  # multi_turn: the response budget is used up
    assert not is_length_truncated(s(Status.TRUNCATED, "max_turns"))  # multi_turn: --multi-turn-max-turns
    assert not is_length_truncated(s(Status.COMPLETED))
    assert not is_length_truncated(s(Status.ABORTED))


def test_overlong_flags_are_checked():
    args = parse_run_args(
        BASE + ["--overlong-filter", "--overlong-buffer-len", "32", "--overlong-penalty-factor", "0.5"]
    )
    assert (args.overlong_filter, args.overlong_buffer_len, args.overlong_penalty_factor) == (True, 32, 0.5)
    args = parse_run_args(BASE)
    assert (args.overlong_filter, args.overlong_buffer_len, args.overlong_penalty_factor) == (False, None, 1.0)
    with pytest.raises(ArgumentError, match=r"--overlong-buffer-len must be in \(0, --rollout-max-response-len 128\]"):
        parse_run_args(BASE + ["--overlong-buffer-len", "129"])
    with pytest.raises(ArgumentError, match=r"--overlong-buffer-len must be in .* got 0"):
        parse_run_args(BASE + ["--overlong-buffer-len", "0"])
    with pytest.raises(ArgumentError, match="--overlong-penalty-factor must be a finite number >= 0, got -1.0"):
        parse_run_args(BASE + ["--overlong-penalty-factor", "-1"])


# Per prompt p0..p5: (response length, status, multi_turn stop reason or None). Reward: exact_match against the
# label "x", so the response text "x" scores 1.0 and "y" 0.0.
CASES = {
    "p0": (3, Status.COMPLETED, None, "x"),  # single-turn, stopped: keeps its mask, no penalty (3 <= 8 - 4)
    "p1": (8, Status.TRUNCATED, None, "x"),  # single-turn, cut at L_max: mask 0, penalty -1
    "p2": (6, Status.COMPLETED, None, "y"),  # stopped after 6 tokens: mask kept, penalty -0.5
    "p3": (7, Status.TRUNCATED, "length", "x"),  # multi_turn, the engine stopped on length: mask 0, penalty -0.75
    "p4": (5, Status.TRUNCATED, "budget", "y"),  # multi_turn, no budget for the next turn: mask 0, penalty -0.25
    "p5": (8, Status.TRUNCATED, "max_turns", "x"),  # multi_turn turn cap: not a length cut, mask kept, penalty -1
}


async def _by_prompt(args, sample, sampling_params):
    n, status, stop_reason, text = CASES[sample.prompt]
    sample.tokens = [1, 2]
    if stop_reason is None:
        sample.append_response_tokens([3] * n, trainable=True, log_probs=[-0.5] * n, weight_version=0, text=text)
    else:  # a multi_turn episode: model turn, tool output (mask 0), model turn
        sample.append_response_tokens([3], trainable=True, log_probs=[-0.5], weight_version=0, text=text)
        sample.append_response_tokens([4, 4], trainable=False, weight_version=0)
        sample.append_response_tokens([3] * (n - 3), trainable=True, log_probs=[-0.5] * (n - 3), weight_version=0)
        sample.metadata["stop_reason"] = stop_reason
    sample.status = status
    return sample


def _generate(tiny_model_dir, tmp_path, **flags):
    m = manager_with_hooks(
        tiny_model_dir,
        tmp_path,
        generate=_by_prompt,
        num_prompts=6,
        n_samples_per_prompt=1,
        rollout_batch_size=6,
        **flags,
    )
    groups, metrics = m.generate(0)
    return {g[0].prompt: g[0] for g in groups}, metrics


def test_overlong_filter_masks_length_cut_responses_only(tiny_model_dir, tmp_path):
    by, metrics = _generate(tiny_model_dir, tmp_path, overlong_filter=True)
    masks = {p: s.loss_mask for p, s in by.items()}
    assert masks == {
        "p0": [1, 1, 1],
        "p1": [0] * 8,
        "p2": [1] * 6,
        "p3": [0] * 7,
        "p4": [0] * 5,
        "p5": [1, 0, 0, 1, 1, 1, 1, 1],
    }
    assert {p: s.is_trainable() for p, s in by.items()} == {
        "p0": True,
        "p1": False,
        "p2": True,
        "p3": False,
        "p4": False,
        "p5": True,
    }
    assert {p for p, s in by.items() if s.metadata.get("overlong_filtered")} == {"p1", "p3", "p4"}
    assert {p: s.reward for p, s in by.items()} == {"p0": 1.0, "p1": 1.0, "p2": 0.0, "p3": 1.0, "p4": 0.0, "p5": 1.0}
    assert metrics["rollout/overlong_filtered_frac"] == 3 / 6
    assert "rollout/overlong_penalty_mean" not in metrics
    assert metrics["rollout/truncated_frac"] == 4 / 6


def test_soft_overlong_punishment_exact_rewards(tiny_model_dir, tmp_path):
    by, metrics = _generate(tiny_model_dir, tmp_path, overlong_buffer_len=4, overlong_penalty_factor=1.0)
    assert {p: s.reward for p, s in by.items()} == {
        "p0": 1.0,
        "p1": 0.0,  # 1.0 - 1.0
        "p2": -0.5,
        "p3": 0.25,  # 1.0 - 0.75
        "p4": -0.25,
        "p5": 0.0,  # 1.0 - 1.0
    }
    assert {p: s.metadata["overlong_penalty"] for p, s in by.items()} == {
        "p0": 0.0,
        "p1": -1.0,
        "p2": -0.5,
        "p3": -0.75,
        "p4": -0.25,
        "p5": -1.0,
    }
    assert all(
        s.loss_mask.count(1) == s.response_length - (2 if p in ("p3", "p4", "p5") else 0) for p, s in by.items()
    )
    assert metrics["rollout/overlong_penalty_mean"] == pytest.approx(-3.5 / 6)
    assert metrics["rollout/overlong_penalized_frac"] == 5 / 6
    assert "rollout/overlong_filtered_frac" not in metrics


def test_overlong_penalty_on_a_dict_reward_goes_to_the_reward_key():
    from vime_core.cli.arguments import default_args
    from vime_core.config import RolloutConfig
    from vime_core.rollout.overlong import apply_overlong

    args = default_args(
        overlong_buffer_len=4, overlong_penalty_factor=2.0, rollout_max_response_len=8, reward_key="acc"
    )
    s = Sample(tokens=[1], reward={"acc": 1.0, "fmt": 1.0}, status=Status.COMPLETED)
    s.append_response_tokens([3] * 6, trainable=True, log_probs=[-0.1] * 6, weight_version=0)
    apply_overlong(RolloutConfig.from_args(args), s)
    assert s.reward == {"acc": 0.0, "fmt": 1.0}  # 1.0 + min(-(6 - 4) / 4 * 2, 0)
    args.reward_key = None
    with pytest.raises(ValueError, match="the reward is a dict \\['acc', 'fmt'\\] without --reward-key"):
        apply_overlong(RolloutConfig.from_args(args), s)


def test_a_client_without_eos_ids_refuses_an_answer_without_finish_reason():
    """Issue 27: without the EOS ids an EOS-ended answer lacking ``finish_reason`` became an untrained abort."""
    from vime_core.engines.client import RouterClientError

    client = RouterClient("http://127.0.0.1:9", "m")
    lps = [-0.5, -0.25, -1.0]
    with pytest.raises(RouterClientError) as e:
        client._output(_choice([4, 5, EOS], None), lps, None, {"max_tokens": 16})
    assert str(e.value) == (
        "the engine's answer has no finish_reason and this RouterClient was built without eos_token_ids, so a "
        "finished answer cannot be told from an aborted one; pass eos_token_ids=eos_token_ids(tokenizer)"
    )
    # a reason the engine gave needs no EOS ids; with ignore_eos the EOS ids do not matter either
    assert client._output(_choice([4, 5, EOS], "stop"), lps, None, {"max_tokens": 16}).finish_reason == "stop"
    out = client._output(_choice([4, 5, 6], None), lps, None, {"max_tokens": 3, "ignore_eos": True})
    assert out.finish_reason == "length"
