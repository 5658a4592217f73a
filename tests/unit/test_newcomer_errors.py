"""What a new user hits first, each as one line with the exact text (issue 35, part 2): a missing flag without
argparse's usage block, a sampling value vLLM would refuse named by its flag, a dotted-path plugin whose module
raises, a corrupt ``model.safetensors``, an ``--output-dir`` that cannot be created; ``vime eval --help`` with
eval's flags only; a help that states its default once and lists the names a plugin flag accepts; flag errors
before torch, transformers, vLLM or Ray is imported."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from vime_core.cli.arguments import ArgumentError, build_parser, parse_run_args
from vime_core.cli.commands import main
from vime_core.plugins.manager import get_plugins
from vime_core.plugins.registry import Lazy, Registry, RegistryError, check_subclass
from vime_core.run.output_dir import check_output_dir, make_output_dir
from vime_core.run.preflight import check_model_weights, check_safetensors

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "p", "label": "1"}\n')
    return path


def _parse(prompts: Path, *argv: str):
    return parse_run_args(["--model", "m", "--prompt-data", str(prompts), *argv])


def test_a_missing_required_flag_is_one_line_without_the_usage_block(capsys):
    assert main(["run", "--prompt-data", "d.jsonl"]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        "vime: error: the following arguments are required: --model (`vime run --help` lists the flags)\n"
    )
    assert captured.out == ""


def test_a_bad_value_is_one_line(capsys):
    assert main(["run", "--model", "m", "--num-rollout", "ten"]) == 2
    assert capsys.readouterr().err == (
        "vime: error: argument --num-rollout: invalid int value: 'ten' (`vime run --help` lists the flags)\n"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rollout-temperature", "-1"], "--rollout-temperature must be in [0, 2] (0: greedy), got -1.0"),
        (["--rollout-temperature", "2.5"], "--rollout-temperature must be in [0, 2] (0: greedy), got 2.5"),
        (["--rollout-temperature", "nan"], "--rollout-temperature must be in [0, 2] (0: greedy), got nan"),
        (["--rollout-max-response-len", "0"], "--rollout-max-response-len must be >= 1 (tokens), got 0"),
        (["--rollout-top-p", "0"], "--rollout-top-p must be in (0, 1] (1: off), got 0.0"),
        (["--rollout-top-p", "1.1"], "--rollout-top-p must be in (0, 1] (1: off), got 1.1"),
        (["--rollout-top-k", "-2"], "--rollout-top-k must be -1 or 0 (off) or a whole number >= 1, got -2"),
        (["--rollout-min-p", "1.5"], "--rollout-min-p must be in [0, 1] (0: off), got 1.5"),
        (["--rollout-repetition-penalty", "0"], "--rollout-repetition-penalty must be a number > 0 (1: off), got 0.0"),
        (["--eval-temperature", "-0.5"], "--eval-temperature must be in [0, 2] (0: greedy), got -0.5"),
        (["--eval-top-p", "0"], "--eval-top-p must be in (0, 1] (1: off), got 0.0"),
        (["--eval-top-k", "-3"], "--eval-top-k must be -1 or 0 (off) or a whole number >= 1, got -3"),
        (["--eval-min-p", "-0.1"], "--eval-min-p must be in [0, 1] (0: off), got -0.1"),
        (["--eval-repetition-penalty", "-1"], "--eval-repetition-penalty must be a number > 0 (1: off), got -1.0"),
        (["--eval-max-response-len", "0"], "--eval-max-response-len must be >= 1, got 0"),
        (
            ["--rollout-sampling-params", '{"temperature": 1}'],
            "--rollout-sampling-params: 'temperature' has its own flag: --rollout-temperature / --eval-temperature",
        ),
        (
            ["--rollout-sampling-params", '{"presence_penalty": 2.5}'],
            "--rollout-sampling-params: presence_penalty must be in [-2, 2], got 2.5",
        ),
        (
            ["--eval-sampling-params", '{"frequency_penalty": -3}'],
            "--eval-sampling-params: frequency_penalty must be in [-2, 2], got -3",
        ),
    ],
)
def test_every_sampling_flag_is_checked_up_front_with_its_name(prompts, argv, message):
    with pytest.raises(ArgumentError) as e:
        _parse(prompts, *argv)
    assert str(e.value) == message


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": 3}, "--eval-set-sampling-params arith: temperature must be in [0, 2] (0: greedy), got 3"),
        ({"max_tokens": 0}, "--eval-set-sampling-params arith: max_tokens must be >= 1 (tokens), got 0"),
        ({"top_k": 1.5}, "--eval-set-sampling-params arith: top_k must be -1 or 0 (off) or a whole number >= 1, "
                         "got 1.5"),
    ],
)  # fmt: skip
def test_each_eval_sets_sampling_fields_are_checked_naming_the_set(prompts, fields, message):
    with pytest.raises(ArgumentError) as e:
        _parse(prompts, "--eval-prompt-data", "arith", str(prompts), "--eval-set-sampling-params", "arith",
               json.dumps(fields))  # fmt: skip
    assert str(e.value) == message


def test_the_edges_of_each_range_pass(prompts):
    args = _parse(
        prompts, "--rollout-temperature", "0", "--rollout-top-p", "1", "--rollout-top-k", "0", "--rollout-min-p",
        "1", "--eval-temperature", "2", "--eval-top-k", "-1", "--rollout-max-response-len", "1",
    )  # fmt: skip
    assert (args.rollout_temperature, args.eval_temperature, args.rollout_top_k) == (0.0, 2.0, 0)


def test_a_group_estimator_with_one_sample_per_prompt_is_warned_about_and_the_std_filter_refused(prompts, caplog):
    _parse(prompts, "--n-samples-per-prompt", "1")
    assert [r.getMessage() for r in caplog.records if r.name == "vime.arguments"] == [
        "WARNING: --advantage-estimator grpo compares the samples of a prompt's group, but --n-samples-per-prompt "
        "is 1: every advantage is 0 and nothing will be trained; give --n-samples-per-prompt 2 or more, or use "
        "reinforce_plus_plus or ppo"
    ]
    caplog.clear()
    _parse(prompts, "--n-samples-per-prompt", "1", "--advantage-estimator", "reinforce_plus_plus")
    assert not [r for r in caplog.records if r.name == "vime.arguments"]
    with pytest.raises(ArgumentError) as e:
        _parse(prompts, "--n-samples-per-prompt", "1", "--dynamic-sampling-filter", "check_reward_nonzero_std",
               "--advantage-estimator", "reinforce_plus_plus")  # fmt: skip
    assert str(e.value) == (
        "--dynamic-sampling-filter check_reward_nonzero_std keeps groups whose rewards differ, but "
        "--n-samples-per-prompt is 1: no group could ever pass"
    )


def test_greedy_sampling_with_a_group_estimator_is_warned_about(prompts, caplog):
    _parse(prompts, "--rollout-temperature", "0", "--n-samples-per-prompt", "4")
    assert [r.getMessage() for r in caplog.records if r.name == "vime.arguments"] == [
        "WARNING: --rollout-temperature 0 samples greedily: the 4 samples of a prompt are the same response, so "
        "--advantage-estimator grpo gives them advantage 0 unless the reward differs between equal responses"
    ]


def test_vime_eval_help_lists_only_evals_flags(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit) as e:
        main(["eval", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    text = " ".join(out.split())
    assert out.startswith("usage: vime eval [-h] [--config CONFIG] [--model MODEL] [--output-dir OUTPUT_DIR]")
    assert "--output-dir OUTPUT_DIR where the evaluation's metrics.jsonl, summary.json and logs/ go (never a " \
        "--config's) (default: outputs/eval)" in text  # fmt: skip
    assert "(required: here or in --config; no default)" in text
    listed = set(re.findall(r"^  (--[a-z0-9-]+)", out, re.M))  # the flags of the help's option lists
    assert {"--eval-prompt-data", "--n-samples-per-eval-prompt", "--eval-temperature", "--reward",
            "--rollout-temperature", "--vllm-router-ip", "--generate", "--sandbox"} <= listed  # fmt: skip
    assert not listed & {"--lr", "--num-rollout", "--prompt-data", "--save-interval", "--weight-sync", "--trainer",
                         "--advantage-estimator", "--resume", "--eval-interval", "--colocate", "--keep-checkpoints",
                         "--lora-rank", "--loop", "--kl-loss-coef"}  # fmt: skip
    run_lines = build_parser().format_help().count("\n")
    assert out.count("\n") < run_lines * 0.6


def test_vime_eval_refuses_a_training_flag_on_its_command_line(prompts):
    with pytest.raises(ArgumentError) as e:
        parse_run_args(["--model", "m", "--eval-prompt-data", "a", str(prompts), "--lr", "1e-5"], command="eval")
    assert str(e.value) == "--lr is a training flag: vime eval trains nothing (`vime eval --help` lists its flags)"


def test_no_help_states_its_default_twice(monkeypatch):
    """A help that says its default in any case (``Default: --rollout-temperature``) is not given a second
    ``(default: None)``; seven did before."""
    monkeypatch.setenv("COLUMNS", "1000")
    for command in ("run", "eval"):
        parser = build_parser(command=command)
        formatter = parser._get_formatter()
        for a in parser._actions:
            if not a.option_strings or not a.help:
                continue
            text = formatter._get_help_string(a)
            if re.search(r"(?i)default", a.help):
                assert "(default: %(default)s)" not in text, (command, a.option_strings[0], text)
    text = " ".join(build_parser().format_help().split())
    expected = "--eval-temperature EVAL_TEMPERATURE sampling temperature of eval rollouts. Default: "
    assert expected + "--rollout-temperature --eval-top-p" in text


def test_plugin_name_flags_list_the_available_names(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "1000")
    text = " ".join(build_parser().format_help().split())
    assert "--trainer TRAINER trainer backend (default: torch); available: megatron, torch" in text
    assert "--weight-sync WEIGHT_SYNC weight-sync strategy (default: disk); available: disk, disk-delta, ipc, " \
        "nccl" in text  # fmt: skip
    assert "--generate GENERATE generate function (default: default); available: coding_agent, default, " \
        "multi_turn" in text  # fmt: skip
    for dest in ("reward", "eval_reward", "advantage_estimator", "sandbox", "agent", "dynamic_sampling_filter",
                 "group_reward", "multi_turn_tool_parser", "agent_tool_parser"):  # fmt: skip
        action = next(a for a in build_parser()._actions if a.dest == dest)
        assert "; available: " in build_parser()._get_formatter()._get_help_string(action), dest
    assert main(["args"]) == 0
    lines = capsys.readouterr().out.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("  --trainer "))
    assert lines[i + 1] == "      trainer backend; available: megatron, torch"


def test_a_dotted_plugin_whose_module_raises_is_one_line_naming_flag_module_and_error(tmp_path, monkeypatch):
    (tmp_path / "broken_reward_mod.py").write_text("x = 1\nraise ValueError('needs the FOO_TOKEN variable')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RegistryError) as e:
        get_plugins().resolve("reward", "broken_reward_mod:score")
    assert str(e.value) == (
        "--reward 'broken_reward_mod:score': importing module 'broken_reward_mod' raised ValueError: needs the "
        f"FOO_TOKEN variable (at {tmp_path / 'broken_reward_mod.py'}:2)"
    )
    with pytest.raises(RegistryError) as e:
        get_plugins().resolve("generate", "no_such_generate_mod:fn")
    assert str(e.value) == (
        "--generate 'no_such_generate_mod:fn': cannot import module 'no_such_generate_mod': No module named "
        "'no_such_generate_mod'"
    )


def test_a_dotted_reward_that_raises_is_one_line_through_the_cli(tmp_path, prompts, capsys, monkeypatch):
    (tmp_path / "broken_reward_cli.py").write_text("import json\njson.loads('{')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["run", "--model", "m", "--prompt-data", str(prompts), "--output-dir", str(tmp_path / "o"),
                 "--reward", "broken_reward_cli.score"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "vime: error: --reward 'broken_reward_cli.score': importing module 'broken_reward_cli' raised "
        "JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1) (at "
    )
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_a_lazily_registered_name_is_listed_without_import_and_checked_when_resolved():
    r = Registry("trainer", "--trainer", check_subclass("vime_core.sandbox.base:Sandbox"))
    r.add("local", Lazy("vime_core.sandbox.local:LocalSandbox"), "p", "d 1")
    r.add("wrong", Lazy("vime_core.rollout.generators.default:generate"), "p", "d 1")
    r.add("missing", Lazy("vime_core.no_such_module:X"), "p", "d 1")
    assert r.names() == ["local", "missing", "wrong"]
    from vime_core.sandbox.local import LocalSandbox

    assert r.get("local") is LocalSandbox and r.get("local") is LocalSandbox
    with pytest.raises(RegistryError) as e:
        r.get("wrong")
    assert str(e.value) == (
        "plugin 'p' (d 1) registers trainer 'wrong' = vime_core.rollout.generators.default.generate: expected a "
        "subclass of "
        "vime_core.sandbox.base.Sandbox, found vime_core.rollout.generators.default.generate"
    )
    with pytest.raises(RegistryError) as e:
        r.get("missing")
    assert str(e.value) == (
        "trainer 'missing' of plugin 'p' (d 1) 'vime_core.no_such_module:X': cannot import module "
        "'vime_core.no_such_module': No module named 'vime_core.no_such_module'"
    )


def _safetensors(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x01\x02", "({size} bytes: shorter than the 8-byte header length)"),
        (struct.pack("<Q", 10**9) + b"{}", "(its header claims 1000000000 bytes, the file has {size}: truncated or "
         "not safetensors)"),
        (struct.pack("<Q", 4) + b"\xff\xfe{}", "(its 4-byte header is not JSON: Expecting value: line 1 column 1 "
         "(char 0))"),
        ("truncated", "(truncated: the header needs {need} bytes, the file has {size})"),
        ("trailing", "(trailing bytes after the tensors: the header needs {need} bytes, the file has {size})"),
    ],
)  # fmt: skip
def test_a_corrupt_safetensors_file_is_named_in_one_line(tmp_path, content, message):
    header = {"__metadata__": {"format": "pt"}, "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    path = tmp_path / "model.safetensors"
    if content == "truncated":
        _safetensors(path, header, b"\0" * 10)
    elif content == "trailing":
        _safetensors(path, header, b"\0" * 20)
    else:
        path.write_bytes(content)
    size = path.stat().st_size
    need = size - 10 + 16 if content == "truncated" else size - 4
    with pytest.raises(ArgumentError) as e:
        check_safetensors(path)
    assert str(e.value) == f"--model: {path} is not a valid safetensors file " + message.format(size=size, need=need)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ArgumentError):
        check_model_weights(tmp_path)


def test_a_whole_safetensors_file_and_the_tiny_model_pass(tmp_path, tiny_model_dir):
    header = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    check_safetensors(_safetensors(tmp_path / "ok.safetensors", header, b"\0" * 16))
    check_model_weights(tiny_model_dir)


def test_a_truncated_model_fails_the_cli_in_one_line_before_anything_starts(tiny_model_dir, prompts, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.is_file():
            data = f.read_bytes()
            (model / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    proc = _cli("run", "--model", str(model), "--prompt-data", str(prompts), "--output-dir", str(tmp_path / "o"),
                "--reward", "digit_fraction", "--no-apply-chat-template")  # fmt: skip
    assert proc.returncode == 2
    size = (model / "model.safetensors").stat().st_size
    assert re.fullmatch(
        rf"vime: error: --model: {model}/model.safetensors is not a valid safetensors file \(truncated: the header "
        rf"needs \d+ bytes, the file has {size}\)\n",
        proc.stderr,
    ), proc.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="as root the permission bits do not refuse: the probe must")
def test_an_output_dir_root_cannot_create_is_one_line(tmp_path):
    with pytest.raises(ArgumentError) as e:
        check_output_dir(Path("/proc/vime-test/out"))
    assert str(e.value) == "--output-dir /proc/vime-test/out: cannot create it in /proc (No such file or directory)"


def test_an_output_dir_that_cannot_be_created_is_one_line(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "f").write_text("x")
    with pytest.raises(ArgumentError) as e:
        make_output_dir(ro / "f" / "out")
    assert str(e.value) == f"--output-dir {ro / 'f' / 'out'}: cannot create it (Not a directory)"
    with pytest.raises(ArgumentError) as e:
        check_output_dir(ro / "f" / "out")
    assert str(e.value) == f"--output-dir {ro / 'f' / 'out'} is under {ro / 'f'}, which is a file; give a directory"


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-m", "vime_core.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip


HEAVY = ("torch", "transformers", "vllm", "ray")

PROBE = """
import sys
from vime_core.cli.commands import main
code = main(sys.argv[1:])
print(code, sorted(m for m in {heavy!r} if m in sys.modules))
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--model", "m", "--prompt-data", "{p}", "--rollout-temperature", "-1"],
        ["run", "--model", "m", "--prompt-data", "{p}", "--rollout-batch-size", "0"],
        ["run", "--prompt-data", "{p}"],
        ["run", "--model", "m", "--prompt-data", "{p}", "--trainer", "torchh"],
        ["run", "--model", "m", "--prompt-data", "{p}", "--weight-sync", "nccll"],
        ["run", "--model", "m", "--prompt-data", "{p}", "--advantage-estimator", "grpoo"],
        ["run", "--model", "m", "--prompt-data", "/no/such.jsonl"],
        ["run", "--model", "/no/such/model", "--prompt-data", "{p}"],
        ["run", "--model", "m", "--prompt-data", "{p}", "--output-dir", "{p}/out"],
        ["eval", "--model", "m", "--eval-prompt-data", "a", "/no/such.jsonl"],
    ],
    ids=["sampling", "batch", "missing", "trainer", "weight-sync", "estimator", "prompts", "model", "output-dir",
         "eval-set"],
)  # fmt: skip
def test_flag_and_file_errors_come_before_torch_transformers_vllm_and_ray_are_imported(prompts, argv):
    """A flag or file error takes well under a second because nothing heavy is imported before it (the figures:
    the report of issue 35); the plugins under plugins/ are on the path as the checkout has them."""
    argv = [a.format(p=prompts) for a in argv]
    plugin_srcs = [str(p) for p in sorted((ROOT / "plugins").glob("*/src"))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *plugin_srcs, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *argv], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert proc.stdout.strip() == "2 []", (proc.stdout, proc.stderr[-2000:])
    assert proc.stderr.startswith("vime: error: ") and proc.stderr.count("\n") == 1, proc.stderr


def test_a_response_budget_that_leaves_no_room_for_a_prompt_is_refused(tiny_model_dir):
    from vime_core.cli.arguments import default_args
    from vime_core.config import RunConfig
    from vime_core.run.preflight import check_response_room

    def cfg(**kw):
        return RunConfig.from_args(default_args(model=str(tiny_model_dir), **kw))

    with pytest.raises(ArgumentError) as e:
        check_response_room(cfg(rollout_max_response_len=2048), tiny_model_dir)
    assert str(e.value) == (
        "--rollout-max-response-len 2048 leaves no room for a prompt in the engines' context of 2048 tokens (the "
        f"model's max_position_embeddings ({tiny_model_dir}/config.json)): vLLM would refuse every request; lower it "
        "or raise --vllm-max-model-len"
    )
    with pytest.raises(ArgumentError) as e:
        check_response_room(cfg(eval_max_response_len=600, vllm_args=["--max-model-len", "512"]), tiny_model_dir)
    assert str(e.value) == (
        "--eval-max-response-len 600 leaves no room for a prompt in the engines' context of 512 tokens "
        "(--vllm-max-model-len): vLLM would refuse every request; lower it or raise --vllm-max-model-len"
    )
    check_response_room(cfg(rollout_max_response_len=2047), tiny_model_dir)
    check_response_room(cfg(rollout_max_response_len=4096, vllm_args=["--max-model-len", "auto"]), tiny_model_dir)


def test_the_vime_command_sends_no_http_access_lines_to_the_log(caplog):
    """vime eval runs its rollout manager in the command's process: httpx logs every request at INFO, which the
    command's logging would print (281 of vime eval's 294 lines)."""
    import logging
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import httpx

    class Ok(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    assert main(["plugins"]) == 0  # any command: the logging set-up is the command's
    server = ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    assert logging.getLogger("httpx").level == logging.WARNING
    caplog.set_level(logging.INFO)  # the root logger, as the command's basicConfig sets it
    try:
        assert httpx.get(f"http://127.0.0.1:{server.server_address[1]}/", trust_env=False).status_code == 200
    finally:
        server.shutdown()
    assert [r.getMessage() for r in caplog.records if r.name.startswith(("httpx", "httpcore"))] == []
