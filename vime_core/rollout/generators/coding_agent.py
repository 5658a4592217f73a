"""The ``coding_agent`` generate function: an unmodified coding agent works on a task in a sandbox, every LLM call it
makes goes through vime's agent gateway to the policy, and the episode becomes token-correct Samples
(``--generate coding_agent --agent NAME --sandbox BACKEND``; reward usually ``--reward tests``).

Per workspace-task row (:mod:`vime_core.data.workspace_task`): lay out the workspace as a git repository, open a
gateway session, run the ``--agent`` harness against it, collect the changed files and the diff, and close the
session into one Sample per trajectory segment; failed episodes are excluded placeholders, never zero rewards.
The steps, flags and metrics: docs/agents.md, "coding_agent".
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import io
import logging
import tarfile
import time
import uuid
from pathlib import Path
from typing import Any

from vime_core.agent.harness import AgentBudget, AgentEndpoint, AgentHarnessError
from vime_core.agent.responders import RouterResponder
from vime_core.agent.tool_parse_failures import tool_parse_metrics
from vime_core.config import CodingAgentConfig
from vime_core.config.context import Engines, PluginContext, rollout_engines, takes_context
from vime_core.data.workspace_task import AgentResult, WorkspaceTask
from vime_core.engines.client import RouterClient
from vime_core.failures import FailureCause, mark_failed
from vime_core.plugins.manager import get_plugins
from vime_core.sandbox.base import SandboxError, SandboxInfraError
from vime_core.types import Sample, Status

logger = logging.getLogger("vime.rollout.coding_agent")

#: never recorded as part of the agent's result: bytecode and tool caches, and the agent CLIs' own state directories
#: (Codex leaves ``.codex/tmp/...`` lock files in its working directory)
SKIP_DIRS = ("__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".codex", ".claude")
GIT_ENV = {
    "GIT_AUTHOR_NAME": "vime",
    "GIT_AUTHOR_EMAIL": "vime@localhost",
    "GIT_COMMITTER_NAME": "vime",
    "GIT_COMMITTER_EMAIL": "vime@localhost",
    "GIT_CONFIG_NOSYSTEM": "1",
}


# -- per-process state -------------------------------------------------------------------------------------------
def gateway_for(engines: Engines, cfg: CodingAgentConfig) -> Any:
    """The rollout process's agent gateway (``engines.extras["agent_gateway"]``), started on first use."""
    gw = engines.extras.get("agent_gateway")
    if gw is not None:
        return gw
    from vime_core.agent.gateway import AgentGateway  # FastAPI: imported only by a process that runs the gateway

    client = engines.client
    backend = RouterResponder.from_client(client) if isinstance(client, RouterClient) else client
    if backend is None or not hasattr(backend, "generate"):
        raise RuntimeError("coding_agent: the engines have no router client (it runs inside vime's rollout)")
    template = cfg.agent_chat_template
    gw = AgentGateway(
        engines.tokenizer,
        backend,
        host="127.0.0.1",
        chat_template=Path(template).read_text() if template else None,
        tool_parser=cfg.agent_tool_parser,
        default_max_tokens=int(cfg.agent_max_tokens or cfg.rollout_max_response_len),
        max_context_len=cfg.rollout_max_context_len,
        weight_version=engines.weight_version,
        history=cfg.agent_history,
    ).start()
    atexit.register(gw.stop)
    engines.extras["agent_gateway"] = gw
    return gw


def harness_for(engines: Engines, ctx: PluginContext) -> Any:
    """The ``--agent`` harness (one instance per rollout process), built by its
    :meth:`~vime_core.agent.harness.AgentHarness.from_context` (a harness reads its own ``--agent-NAME-*`` flags).

    :raises ValueError: ``--agent`` is not set.
    """
    name = ctx.coding_agent.agent
    if not name:
        raise ValueError("--generate coding_agent needs --agent NAME (e.g. claude-code, codex; see `vime plugins`)")
    cache = engines.extras.setdefault("agent_harnesses", {})
    if name not in cache:
        cache[name] = get_plugins().resolve("agent", name).from_context(ctx)
    return cache[name]


# -- workspace ---------------------------------------------------------------------------------------------------
def _tar(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def layout_workspace(sb: Any, files: dict[str, str]) -> str:
    """Unpack ``files`` into the sandbox workspace and commit them to a new git repository.

    :return: the base commit id.
    :raises SandboxInfraError: unpacking or git failed (git missing in the image included: infrastructure).
    """
    ws = sb.workspace
    script = (
        'set -e; mkdir -p -- "$1"; cd "$1"; tar -x -f -; git init -q . ; git add -A; '
        "git -c commit.gpgsign=false commit -q --allow-empty -m task; git rev-parse HEAD"
    )
    r = await sb.exec(["/bin/sh", "-c", script, "sh", ws], stdin=_tar(files), env=GIT_ENV, timeout=120.0)
    if not r.ok:
        raise SandboxInfraError(
            f"{sb.NAME} sandbox: laying out the task workspace failed (exit {r.exit_code}; the image needs "
            f"tar and git): {r.stderr[-500:]}"
        )
    return r.stdout.strip().splitlines()[-1]


async def collect_workspace(sb: Any, task: WorkspaceTask, base: str, max_file_bytes: int) -> AgentResult:
    """The agent's result: changed files (vs ``task.files``) and ``git diff --binary`` against ``base``.

    :raises SandboxInfraError: the sandbox could not archive its workspace.
    """

    ws = sb.workspace
    current, skipped = await _read_workspace(sb, ws, max_file_bytes)
    changed: dict[str, str | None] = {p: t for p, t in current.items() if task.files.get(p) != t}
    for p in task.files:
        if p not in current and p not in skipped:
            changed[p] = None
    d = await sb.exec(
        ["/bin/sh", "-c", f'cd "$1" && git add -A >/dev/null 2>&1; git diff --cached --binary {base}', "sh", ws],
        env=GIT_ENV,
        timeout=120.0,
        max_output_bytes=4 << 20,
    )
    diff = d.stdout if d.exit_code == 0 else ""
    return AgentResult(changed=changed, diff=diff, skipped=skipped)


async def _read_workspace(sb: Any, ws: str, max_file_bytes: int) -> tuple[dict[str, str], dict[str, str]]:
    """path → text of every regular file in the workspace (outside ``.git`` and caches), and skipped path → reason.

    :raises SandboxInfraError: the sandbox could not archive its workspace.
    """
    import tempfile

    files: dict[str, str] = {}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="vime-agent-ws-") as tmp:
        try:
            await sb.download_dir(ws, tmp, max_bytes=256 << 20)
        except (OSError, FileNotFoundError) as e:
            raise SandboxInfraError(f"{sb.NAME} sandbox: reading the agent's workspace failed: {e}") from e
        root = Path(tmp)
        for p in sorted(root.rglob("*")):
            rel = p.relative_to(root)
            if not p.is_file() or rel.parts[0] == ".git" or any(part in SKIP_DIRS for part in rel.parts):
                continue
            path = rel.as_posix()
            size = p.stat().st_size
            if size > max_file_bytes:
                skipped[path] = f"larger than --agent-max-file-bytes ({size} bytes)"
                continue
            try:
                files[path] = p.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                skipped[path] = "binary (not UTF-8)"
    return files, skipped


# -- the generate function ---------------------------------------------------------------------------------------
def _task_prompt(sample: Sample) -> str:
    p = sample.prompt
    if isinstance(p, str):
        return p
    users = [m.get("content") for m in p if m.get("role") == "user" and isinstance(m.get("content"), str)]
    if not users:
        raise ValueError("coding_agent: the prompt has no user message to give the agent")
    return users[-1]


def _failed(sample: Sample, why: str, cause: FailureCause, error: BaseException | None = None) -> Sample:
    """The input sample as an excluded placeholder (status ``failed`` with ``cause``: never scored, never trained)."""
    mark_failed(sample, cause, error if error is not None else why)
    sample.metadata["excluded"] = why
    return sample


@takes_context
async def generate(ctx: PluginContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample | list[Sample]:
    """Run one agent episode (see the module docstring).

    :return: the episode's Samples (one per trajectory segment, shared ``episode_id``), or the input sample as a
        ``failed`` placeholder.
    :raises ValueError: ``--agent`` missing, a sandbox backend that cannot expose host ports, a malformed row.
    """
    cfg = ctx.coding_agent
    engines = rollout_engines(ctx)
    task = WorkspaceTask.from_metadata(sample.metadata)
    prompt = _task_prompt(sample)
    harness = harness_for(engines, ctx)
    gw = gateway_for(engines, cfg)
    gw.weight_version = engines.weight_version
    backend = cfg.sandbox or "local"
    sandbox_cls = get_plugins().resolve("sandbox", backend)
    max_tokens = int(cfg.agent_max_tokens or sampling_params.get("max_tokens") or 1024)
    max_turns = int(cfg.agent_max_turns) or None
    budget = AgentBudget(max_turns=max_turns, max_tokens=max_tokens, wall_time_s=float(cfg.agent_wall_time))
    forced = {k: sampling_params[k] for k in ("temperature", "top_p", "top_k", "seed") if k in sampling_params}
    forced["max_tokens"] = max_tokens
    open_kw: dict[str, Any] = {"sampling_params": forced}
    if "max_turns" in inspect.signature(gw.open_session).parameters:
        open_kw["max_turns"] = max_turns
    sid = f"vime-ep-{uuid.uuid4().hex}"
    opened = False
    t0 = time.monotonic()
    try:
        async with sandbox_cls.from_context(ctx) as sb:
            base = await layout_workspace(sb, task.files)
            gw.open_session(sid, **open_kw)
            opened = True
            try:
                hostport = await sb.expose_host_port(gw.port, gw.host)
            except NotImplementedError as e:
                raise ValueError(
                    f"--sandbox {backend}: this backend cannot expose the agent gateway to the sandbox ({e}); "
                    "use local, docker or localvm"
                ) from e
            endpoint = AgentEndpoint(f"http://{hostport}", sid, gw.served_model_name)
            await harness.install(sb)
            run = await harness.run(sb, prompt=prompt, endpoint=endpoint, budget=budget, cwd=sb.workspace)
            result = await collect_workspace(sb, task, base, int(cfg.agent_max_file_bytes))
    except (AgentHarnessError, SandboxError) as e:
        if opened:
            gw.drop_session(sid)
        logger.warning("agent episode %s failed (excluded): %s: %s", sid, type(e).__name__, e)
        cause = FailureCause.SANDBOX_ERROR if isinstance(e, SandboxError) else FailureCause.AGENT_ERROR
        return _failed(sample, "agent episode failed (infrastructure)", cause, e)
    except BaseException:
        if opened:
            gw.drop_session(sid)
        raise
    result.agent_status, result.exit_code, result.duration_s = run.status, run.exit_code, run.duration_s
    meta = {
        # killed at its own --agent-wall-time: the policy's doing, so scored and trained (vime_core.failures)
        "policy_timeout": run.status == "timeout",
        "agent_result": result.to_dict(),
        "agent": {
            "name": cfg.agent if cfg.agent is not None else "",
            "status": run.status,
            "exit_code": run.exit_code,
            "duration_s": run.duration_s,
            "episode_s": time.monotonic() - t0,
            "final_message": run.final_message[-2000:],
            "stderr_tail": run.stderr[-2000:],
            "metadata": run.metadata,
        },
    }
    if cfg.agent_record_turns:
        meta["agent_turns"] = [turn_record_dict(t) for t in gw.session_turns(sid)]
    samples = await asyncio.to_thread(gw.close_session, sid, sample, None, extra_metadata=meta)
    if not samples:
        sample.metadata.update(meta)
        why = f"the agent made no model call (agent status {run.status}, exit {run.exit_code})"
        return _failed(sample, why, FailureCause.AGENT_ERROR)
    return samples


def turn_record_dict(turn: Any) -> dict[str, Any]:
    """A :class:`~vime_core.agent.trajectory.TurnRecord` as plain data (``--agent-record-turns``):
    ``prompt_ids``/``output_ids`` (token ids), ``output_log_probs`` (floats ≤ 0), ``weight_versions`` (one per output
    token), ``finish_reason``, ``ill_formed``; ``TurnRecord(**d)`` rebuilds it (e.g. for ``check_token_exact``)."""
    return {
        "prompt_ids": list(turn.prompt_ids),
        "output_ids": list(turn.output_ids),
        "output_log_probs": list(turn.output_log_probs),
        "weight_versions": list(turn.weight_versions),
        "finish_reason": turn.finish_reason,
        "ill_formed": bool(turn.ill_formed),
    }


def rollout_metrics(samples: list[Sample]) -> dict[str, float]:
    """``coding_agent/*`` metrics of one step: episodes, segments per episode, failed (excluded) episodes, agent
    end states, files changed per episode; and the gateway's tool-call parse failures by reason
    (``agent/tool_parse_failures/<reason>``, :func:`~vime_core.agent.tool_parse_failures.tool_parse_metrics`)."""
    episodes: dict[str, Sample] = {}
    failed = 0
    for s in samples:
        if s.status == Status.FAILED:
            failed += 1
        elif s.episode_id is not None:
            episodes.setdefault(s.episode_id, s)
    n = max(len(episodes) + failed, 1)
    statuses = [(s.metadata.get("agent") or {}).get("status") for s in episodes.values()]
    segs = sum(1 for s in samples if s.status != Status.FAILED)
    return {
        "coding_agent/episodes": float(len(episodes)),
        "coding_agent/failed_frac": failed / n,
        "coding_agent/segments_per_episode": segs / max(len(episodes), 1),
        "coding_agent/completed_frac": statuses.count("completed") / n,
        "coding_agent/max_turns_frac": statuses.count("max_turns") / n,
        "coding_agent/timeout_frac": statuses.count("timeout") / n,
        "coding_agent/error_frac": statuses.count("error") / n,
        "coding_agent/files_changed_mean": sum(
            len((s.metadata.get("agent_result") or {}).get("changed") or {}) for s in episodes.values()
        )
        / max(len(episodes), 1),
        **tool_parse_metrics(samples),
    }
