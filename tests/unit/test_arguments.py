"""Argument namespaces: framework flags, YAML configs, --vllm-* / --router-* forwarding with exact values."""

import pytest

from vime_core.cli.arguments import ArgumentError, parse_run_args

pytestmark = pytest.mark.unit

BASE = ["--model", "m", "--prompt-data", "d.jsonl"]


def test_passthrough_forwarding_exact_values():
    args = parse_run_args(
        BASE
        + [
            "--vllm-max-model-len",
            "512",
            "--vllm-enforce-eager",
            "--router-policy",
            "random",
            "--router-request-timeout-secs=30",
            "--vllm-api-key",
            "a",
            "b",
            "--lr",
            "2e-6",
        ]
    )
    assert args.vllm_args == ["--max-model-len", "512", "--enforce-eager", "--api-key", "a", "b"]
    assert args.router_args == ["--policy", "random", "--request-timeout-secs", "30"]
    assert args.lr == 2e-6


def test_vime_owned_passthrough_flags_are_refused_with_the_vime_flag():
    with pytest.raises(ArgumentError, match=r"--vllm-seed: vime sets the vLLM flag --seed itself; use --seed"):
        parse_run_args(BASE + ["--vllm-seed", "3"])
    with pytest.raises(ArgumentError, match=r"--router-worker-urls: .* use --rollout-num-engines"):
        parse_run_args(BASE + ["--router-worker-urls", "http://x"])


def test_misspelled_flags_get_did_you_mean():
    with pytest.raises(ArgumentError, match=r"did you mean --vllm-max-model-len\?"):
        parse_run_args(BASE + ["--vllm-max-modle-len", "5"])
    with pytest.raises(ArgumentError, match=r"did you mean --router-policy\?"):
        parse_run_args(BASE + ["--router-polcy", "random"])
    with pytest.raises(ArgumentError, match=r"unknown flag --rollout-batch-szie; did you mean --rollout-batch-size\?"):
        parse_run_args(BASE + ["--rollout-batch-szie", "4"])


def test_yaml_config_and_command_line_wins(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "model: m\nprompt_data: data/train.jsonl\nlr: 3.0e-6\nrollout-batch-size: 4\n"
        "apply_chat_template: false\nvllm-max-model-len: 256\nvllm-enforce-eager: true\n"
    )
    args = parse_run_args(["--config", str(cfg), "--rollout-batch-size", "2"])
    assert args.lr == 3e-6 and args.rollout_batch_size == 2 and args.apply_chat_template is False
    assert args.prompt_data == (tmp_path / "data" / "train.jsonl")  # relative to the config file
    assert args.vllm_args == ["--max-model-len", "256", "--enforce-eager"]


def test_bad_combinations_are_named():
    with pytest.raises(ArgumentError, match="--prompt-data is required"):
        parse_run_args(["--model", "m"])
    with pytest.raises(ArgumentError, match="must divide rollout-batch-size × n-samples-per-prompt = 32"):
        parse_run_args(BASE + ["--global-batch-size", "5"])
    with pytest.raises(ArgumentError, match="go together"):
        parse_run_args(BASE + ["--vllm-router-ip", "127.0.0.1"])
    with pytest.raises(ArgumentError, match="file not found"):
        parse_run_args(["--config", "/nonexistent.yaml"])


def test_sandbox_that_does_not_outlive_the_agent_is_refused_with_the_fix(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "p", "label": "x"}\n')
    base = ["--model", "m", "--prompt-data", str(data), "--generate", "coding_agent", "--agent-wall-time", "600"]
    for sandbox_s in ("600", "300"):
        with pytest.raises(ArgumentError) as e:
            parse_run_args(base + ["--sandbox-wall-time", sandbox_s])
        assert str(e.value) == (
            f"--sandbox-wall-time {sandbox_s} s is not longer than --agent-wall-time 600 s: the sandbox would expire "
            "while the agent still runs or before its workspace is collected and scored, so every episode would "
            "fail. Give the sandbox headroom, e.g. --sandbox-wall-time 900 (or lower --agent-wall-time, or "
            "--sandbox-wall-time 0 for no limit)"
        )
    assert parse_run_args(base + ["--sandbox-wall-time", "601"]).sandbox_wall_time == 601.0
    assert parse_run_args(base + ["--sandbox-wall-time", "0"]).sandbox_wall_time == 0.0  # no limit
    # other generate functions do not run an agent: no constraint
    assert (
        parse_run_args(["--model", "m", "--prompt-data", str(data), "--sandbox-wall-time", "10"]).generate == "default"
    )


def test_external_engines_set_the_engine_count_and_refuse_what_does_not_apply():
    """``--rollout-external --rollout-external-engine-addrs`` (slime's flags): one engine per address, no CPU binding
    derived for them, and each flag that would start, place or shape engines vime does not start is named."""
    ext = ["--rollout-external", "--rollout-external-engine-addrs", "127.0.0.1:8001", "10.0.0.2:8002"]
    args = parse_run_args(BASE + ext)
    assert args.rollout_num_engines == 2 and args.rollout_cpu_bind is None
    assert args.rollout_external_engine_addrs == ["127.0.0.1:8001", "10.0.0.2:8002"]
    refused = [
        (["--rollout-external"], "--rollout-external and --rollout-external-engine-addrs HOST:PORT [...] go together"),
        (ext[1:], "--rollout-external and --rollout-external-engine-addrs HOST:PORT [...] go together"),
        (
            ["--rollout-external", "--rollout-external-engine-addrs", "localhost"],
            "--rollout-external-engine-addrs: expected HOST:PORT, got 'localhost'",
        ),
        (
            ["--rollout-external", "--rollout-external-engine-addrs", "h:1", "h:1"],
            "--rollout-external-engine-addrs names an engine twice: h:1 h:1",
        ),
        (
            ext + ["--vllm-max-model-len", "512"],
            "--rollout-external: the --vllm-* flags (--max-model-len 512; set them where the engines start) does not "
            "apply to engines vime does not start",
        ),
        (
            ext + ["--rollout-num-engines", "3"],
            "--rollout-external: --rollout-num-engines (the engine count is the addresses') does not apply to "
            "engines vime does not start",
        ),
        (
            ext + ["--lora-rank", "8"],
            "--rollout-external: --lora-rank (the adapters are loaded into engines vime starts with LoRA serving) "
            "does not apply to engines vime does not start",
        ),
    ]
    for extra, message in refused:
        with pytest.raises(ArgumentError) as e:
            parse_run_args(BASE + extra)
        assert str(e.value) == message, extra
