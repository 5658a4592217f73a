"""Prompt checks that need the tokenizer (:mod:`vime_core.data.prompt_checks`): a model directory without a
tokenizer, a missing chat template while ``--apply-chat-template`` is on, prompts longer than
``--rollout-max-prompt-len`` (left out and counted, or an error naming the file and line); and the rollout
manager's buffer holds only the prompts that fit."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest

from tests.support.rollout import manager_with_hooks
from vime_core.data.prompt_checks import check_prompts, filter_overlong_prompts, load_tokenizer
from vime_core.data.source import DataError, read_rows
from vime_core.rollout.generators.default import encode_prompt

pytestmark = pytest.mark.unit


def _args(path, **kw):
    base = dict(
        prompt_data=path,
        generate="default",
        apply_chat_template=True,
        rollout_max_prompt_len=None,
        filter_overlong_prompts=True,
    )
    return argparse.Namespace(**{**base, **kw})


def _data(tmp_path, prompts):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path, read_rows(path, "prompt", None, None)


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(tiny_model_dir, out)
    return out


def test_a_model_directory_without_a_tokenizer_names_the_directory(model_copy, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json"):
        (model_copy / name).unlink(missing_ok=True)
    path, rows = _data(tmp_path, ["a"])
    with pytest.raises(DataError, match=rf"^--model {model_copy}: no tokenizer in the model directory \(none of "):
        check_prompts(_args(path), model_copy, rows)


def test_a_missing_chat_template_names_the_flag_or_the_line(model_copy, tmp_path):
    config = json.loads((model_copy / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model_copy / "tokenizer_config.json").write_text(json.dumps(config))
    (model_copy / "chat_template.jinja").unlink(missing_ok=True)
    assert not getattr(load_tokenizer(model_copy), "chat_template", None)
    path, rows = _data(tmp_path, ["a"])
    with pytest.raises(
        DataError, match=rf"^--apply-chat-template is on but the tokenizer of --model {model_copy} has"
    ):
        check_prompts(_args(path), model_copy, rows)
    assert check_prompts(_args(path, apply_chat_template=False), model_copy, rows) == 0  # text as it is: fine
    path, rows = _data(tmp_path, ["a", [{"role": "user", "content": "b"}]])
    with pytest.raises(DataError, match=rf"^{path}:line 2: the prompt is a list of chat messages but the tokenizer"):
        check_prompts(_args(path, apply_chat_template=False), model_copy, rows)


def test_overlong_prompts_are_left_out_and_counted_or_an_error(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    prompts = ["short", "a much longer prompt " * 20, "ok too", "another very long prompt " * 20]
    lengths = [len(encode_prompt(tok, p, True)) for p in prompts]
    limit = max(lengths[0], lengths[2])
    assert lengths[1] > limit and lengths[3] > limit
    path, rows = _data(tmp_path, prompts)
    kept, left_out = filter_overlong_prompts(rows, tok, _args(path, rollout_max_prompt_len=limit))
    assert [r["prompt"] for r in kept] == ["short", "ok too"] and left_out == 2
    assert check_prompts(_args(path, rollout_max_prompt_len=limit), tiny_model_dir, rows) == 2
    strict = _args(path, rollout_max_prompt_len=limit, filter_overlong_prompts=False)
    with pytest.raises(
        DataError,
        match=rf"^{path}:line 2: the prompt has {lengths[1]} tokens, more than --rollout-max-prompt-len {limit} ",
    ):
        filter_overlong_prompts(rows, tok, strict)
    with pytest.raises(DataError, match=r"every prompt has more than --rollout-max-prompt-len 1 tokens"):
        filter_overlong_prompts(rows, tok, _args(path, rollout_max_prompt_len=1))
    assert filter_overlong_prompts(rows, tok, _args(path)) == (rows, 0)  # no limit


def test_the_buffer_holds_only_prompts_that_fit(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    limit = len(encode_prompt(tok, "p1", False))
    m = manager_with_hooks(
        tiny_model_dir,
        tmp_path,
        num_prompts=3,
        rollout_max_prompt_len=limit,
        apply_chat_template=False,
        filter_overlong_prompts=True,
    )
    # p0..p2 have the same length: all fit; one token less and none would
    assert len(m.groups.data_source) == 3
    with pytest.raises(DataError, match="every prompt has more than"):
        manager_with_hooks(
            tiny_model_dir,
            tmp_path,
            num_prompts=3,
            rollout_max_prompt_len=limit - 1,
            apply_chat_template=False,
            filter_overlong_prompts=True,
        )
