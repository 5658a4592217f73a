"""A CLI that explains itself: every flag has help, --help and `vime args` show defaults, config-file errors name
the file, the line and the key (with the closest flag), with the exact message text."""

import argparse

import pytest

from vime_core.cli.arguments import ArgumentError, HelpFormatter, build_parser, flags_without_help, parse_run_args
from vime_core.cli.commands import main

pytestmark = pytest.mark.unit


def test_every_registered_flag_has_help():
    """Framework flags and every installed plugin's registered flags (``vime run`` loads them all)."""
    parser = build_parser()
    assert len([a for a in parser._actions if a.option_strings]) > 150
    assert flags_without_help(parser) == []


def test_flags_without_help_finds_a_missing_one():
    p = argparse.ArgumentParser()
    p.add_argument("--ok", help="fine")
    p.add_argument("--bare", type=int, default=3)
    p.add_argument("--blank", help="  ")
    p.add_argument("--hidden", help=argparse.SUPPRESS)
    assert flags_without_help(p) == ["--bare", "--blank"]


def test_help_shows_defaults(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping inside a hyphenated flag name
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps at the terminal width
    assert "--seed SEED seed of data shuffling, the trainer and the engines (vLLM --seed) (default: 1234)" in out
    assert "--lr LR peak policy learning rate (AdamW); see --lr-decay-style (default: 1e-06)" in out
    # a help that already states its default is not given a second one
    assert "W&B group that gathers related runs (default: none) --wandb-run-name" in out


def test_help_formatter_appends_default_once():
    p = argparse.ArgumentParser(formatter_class=HelpFormatter, prog="x")
    p.add_argument("--a", type=int, default=7, help="tokens")
    p.add_argument("--b", default=None, help="a path (default: OUTPUT_DIR/b)")
    text = " ".join(p.format_help().split())
    assert "--a A tokens (default: 7)" in text
    assert "--b B a path (default: OUTPUT_DIR/b)" in text and "(default: None)" not in text


def test_vime_args_prints_help_under_each_flag(capsys):
    assert main(["args"]) == 0
    lines = capsys.readouterr().out.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("  --num-rollout "))
    assert lines[i].split() == ["--num-rollout", "owner=vime", "default=10"]
    assert lines[i + 1] == "      number of RL steps"


@pytest.fixture
def cfg(tmp_path):
    def write(body: str):
        path = tmp_path / "c.yaml"
        path.write_text("model: m\nprompt_data: d.jsonl\n" + body)
        return path

    return write


@pytest.mark.parametrize(
    "body, message",
    [
        ("rolout_batch_size: 4\n", "{p}:3: unknown key 'rolout_batch_size'; did you mean rollout_batch_size "
         "(--rollout-batch-size)?"),
        ("lr: 1e-6\nkl-los-coef: 0.1\n", "{p}:4: unknown key 'kl-los-coef'; did you mean kl_loss_coef "
         "(--kl-loss-coef)?"),
        ("zzzqqq: 1\n", "{p}:3: unknown key 'zzzqqq'; see `vime args` for every flag"),
        ("num_rollout: ten\n", "{p}:3: key 'num_rollout' (--num-rollout): expected int, got 'ten'"),
        ("lr: fast\n", "{p}:3: key 'lr' (--lr): expected float, got 'fast'"),
        ("num_rollout: true\n", "{p}:3: key 'num_rollout' (--num-rollout): expected a value, got True"),
        ("loop: async\n", "{p}:3: key 'loop' (--loop): expected one of sync, one-step-off, fully-async, got 'async'"),
        ("use_tis: 1\n", "{p}:3: key 'use_tis' (--use-tis): expected true or false, got 1"),
        ("rollout_cpu_bind: {a: 1}\n", "{p}:3: key 'rollout_cpu_bind' (--rollout-cpu-bind): expected a value, got a "
         "mapping {{'a': 1}}"),
        ("seed: [1, 2]\n", "{p}:3: key 'seed' (--seed): expected one value, got a list [1, 2]"),
        ("rollout_stop_token_ids: [1, x]\n", "{p}:3: key 'rollout_stop_token_ids' (--rollout-stop-token-ids): "
         "expected int, got 'x'"),
    ],
)  # fmt: skip
def test_config_errors_name_file_line_and_key(cfg, body, message):
    path = cfg(body)
    with pytest.raises(ArgumentError) as e:
        parse_run_args(["--config", str(path)])
    assert str(e.value) == message.format(p=path)


def test_config_error_through_the_cli(cfg, capsys):
    path = cfg("rollout_batch_sise: 4\n")
    assert main(["run", "--config", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"vime: error: {path}:3: unknown key 'rollout_batch_sise'; did you mean rollout_batch_size "
        "(--rollout-batch-size)?\n"
    )


def test_valid_config_values_still_parse(cfg):
    args = parse_run_args(
        ["--config", str(cfg("rollout_stop_token_ids: [1, 2]\nuse_tis: false\nloop: one-step-off\nlr: 2.0e-6\n"
                             "vllm-max-model-len: 256\nsave_hf: false\nuse_rollout_logprobs: true\n"))]
    )  # fmt: skip
    assert (args.rollout_stop_token_ids, args.use_tis, args.loop, args.lr) == ([1, 2], False, "one-step-off", 2e-6)
    assert args.save_hf is False and args.vllm_args == ["--max-model-len", "256"]


class _Parsed(Exception):
    pass


@pytest.mark.parametrize("command", ["report", "model", "data", "plugins", "sandbox", "agent"])
def test_every_subcommand_flag_has_help(command, monkeypatch):
    """The parsers of the other `vime` commands (and their sub-commands): caught when they parse, then checked."""
    seen: list[argparse.ArgumentParser] = []

    def capture(self, args=None, namespace=None):
        seen.append(self)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(_Parsed):
        main([command])
    parsers = list(seen)
    for p in seen:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                parsers.extend(a.choices.values())
    assert len(parsers) >= 1
    for p in parsers:
        assert flags_without_help(p) == [], p.prog
        positional = [a.dest for a in p._actions if not a.option_strings and not a.help and a.nargs != "A..."]
        assert positional == [], p.prog


def test_vime_help_lists_every_command_with_a_line(capsys):
    from vime_core.cli.commands import COMMANDS, SUMMARIES, main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert set(SUMMARIES) == set(COMMANDS)
    for name in COMMANDS:
        assert f"  {name:9s} {SUMMARIES[name]}\n" in out


def test_vime_args_prints_paths_plainly(capsys):
    from vime_core.cli.commands import main

    assert main(["args"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("--output-dir "))
    assert line.split()[1:] == ["owner=vime", "default=outputs/run"]
