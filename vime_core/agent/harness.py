"""The agent-harness contract: how vime runs an unmodified coding agent (Claude Code, Codex, …) in a sandbox.

A harness subclasses :class:`AgentHarness` (registered through ``vime_register_agent_harnesses``, ``--agent NAME``):
:meth:`~AgentHarness.install` makes its CLI runnable in a sandbox, :meth:`~AgentHarness.run` runs it once against
the gateway (:class:`AgentEndpoint`, its only network) within an :class:`AgentBudget` and says how it ended
(:class:`AgentRunResult`). :class:`NpmAgentHarness` is the base of CLIs shipped on npm. The episode around a run,
the budget and what each CLI is told: docs/agents.md, "Agent harnesses".
"""

from __future__ import annotations

import abc
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from vime_core.sandbox.base import SANDBOX_AGENTS_DIR, agents_cache_dir

if TYPE_CHECKING:
    from vime_core.sandbox.base import ExecResult, Sandbox

AgentApi = Literal["anthropic", "openai-chat", "openai-responses"]
AgentEndStatus = Literal["completed", "max_turns", "timeout", "error"]


class AgentHarnessError(RuntimeError):
    """The agent could not be installed or started (infrastructure, not the model's doing): exclude the episode."""


@dataclass(frozen=True)
class AgentEndpoint:
    """Where the agent sends its LLM calls, as seen from inside the sandbox.

    :param base_url: gateway root URL reachable in the sandbox, e.g. ``http://127.0.0.1:41234`` (no ``/v1``).
    :param api_key: the per-episode key; it is the gateway session id.
    :param model: the model name the agent must request (the gateway's served model name).
    """

    base_url: str
    api_key: str
    model: str


@dataclass(frozen=True)
class AgentBudget:
    """Limits of one episode.

    :param max_turns: agent turns (LLM calls the CLI may make), or ``None`` for the CLI's default.
    :param max_tokens: output tokens per LLM call.
    :param wall_time_s: seconds before the agent process is killed (status ``"timeout"``).
    """

    max_turns: int | None = 8
    max_tokens: int = 1024
    wall_time_s: float = 600.0


@dataclass
class AgentRunResult:
    """How an agent run ended.

    :param status: ``completed`` (the agent finished on its own), ``max_turns`` (stopped by the turn budget),
        ``timeout`` (killed at ``wall_time_s``), ``error`` (the agent exited with an error after starting, e.g. an
        API error it could not recover from; the episode's samples stay usable).
    :param exit_code: the CLI's exit code.
    :param duration_s: wall time of the run, seconds.
    :param final_message: the agent's last text answer when the CLI reports one.
    :param stdout: CLI stdout (possibly truncated by the sandbox's output limit).
    :param stderr: CLI stderr (same).
    """

    status: AgentEndStatus
    exit_code: int
    duration_s: float
    final_message: str = ""
    stdout: str = ""
    stderr: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


def json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects in ``text``, one per line, in order (an agent CLI's JSON Lines events or ``--output-format
    json`` result on stdout). Lines that are not a JSON object (log lines, a line cut by the sandbox's output limit,
    a JSON array or scalar) are skipped."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
    return out


class AgentHarness(abc.ABC):
    """Runs one agent CLI inside a :class:`~vime_core.sandbox.base.Sandbox`.

    Subclasses set :attr:`NAME` and :attr:`api` (which gateway API the agent speaks) and implement
    :meth:`install` and :meth:`run`. Construct with keyword options (:meth:`from_config` reads the
    ``--agent-<name>-*`` flags that the plugin declares as :attr:`FLAGS` and registers through
    ``vime_register_flags``).
    """

    NAME: ClassVar[str] = ""
    api: ClassVar[AgentApi] = "anthropic"
    #: the harness's own flag class (a :class:`~vime_core.config.PluginConfig` registered through
    #: ``vime_register_flags``), ``None`` for a harness without flags
    FLAGS: ClassVar[type | None] = None

    @classmethod
    def from_config(cls, flags: Any = None) -> AgentHarness:
        """A harness configured from its own flags: ``flags`` is the run's instance of :attr:`FLAGS` (``None``: the
        defaults). Default: no options."""
        return cls()

    @classmethod
    def from_context(cls, ctx: Any) -> AgentHarness:
        """A harness configured for a run from its :class:`~vime_core.config.context.PluginContext`:
        :meth:`from_config` of ``ctx.plugin(FLAGS)``. A harness written for vime 0.x (it overrides :meth:`from_args`
        only) is built by its ``from_args`` from the run's Namespace, with a ``DeprecationWarning``."""
        from vime_core.config.context import legacy_args, overrides_from_args_only, warn_built_from_args

        if overrides_from_args_only(cls, AgentHarness):
            warn_built_from_args(cls, "agent harness", "from_config(flags)")
            return cls.from_args(legacy_args(ctx.config))
        return cls.from_config(ctx.plugin(cls.FLAGS) if cls.FLAGS is not None else None)

    @classmethod
    def from_args(cls, args: Any) -> AgentHarness:
        """Deprecated, goes in vime 0.2 (use :meth:`from_context` or :meth:`from_config`): a harness configured from
        a ``vime run`` Namespace (``None``: defaults); what builds a harness written for vime 0.1 that overrides it
        alone (:meth:`from_context` warns then)."""
        return cls.from_config(cls.FLAGS.from_args(args) if cls.FLAGS is not None else None)  # type: ignore[attr-defined]

    def prepare(self, *, force: bool = False, log: Any = print) -> Path | None:
        """Host-side preparation done once per machine (download the CLI into a cache), run by
        ``vime agent prepare NAME``; idempotent. Default: nothing to prepare (``None``).

        :raises AgentHarnessError: the preparation failed.
        """
        return None

    @abc.abstractmethod
    async def install(self, sandbox: Sandbox) -> None:
        """Make the agent CLI runnable in ``sandbox`` (install it, or check that a prepared copy is present).

        Idempotent. Runs with the sandbox's network setting (normally off): install from a copy the host prepared.

        :raises AgentHarnessError: the CLI cannot be made available.
        """

    @abc.abstractmethod
    async def run(
        self, sandbox: Sandbox, *, prompt: str, endpoint: AgentEndpoint, budget: AgentBudget, cwd: str | None = None
    ) -> AgentRunResult:
        """Run the agent non-interactively on ``prompt`` in ``cwd`` (default: the sandbox workspace).

        Writes the agent's configuration so that it uses only ``endpoint``, launches it with the budget, waits
        (at most ``budget.wall_time_s`` seconds) and reports how it ended.

        :raises AgentHarnessError: the agent could not be started (missing CLI, bad configuration).
        """


# ---------------------------------------------------------------------------------------------------------------
# Agents published on npm as native executables (Claude Code, Codex): prepared once on the host, shown to sandboxes


def npm_executable() -> str:
    """The host's ``npm`` (``PATH``, then ``/usr/bin/npm``).

    :raises AgentHarnessError: npm is not installed (``apt-get install nodejs npm``; scripts/install.sh does it).
    """
    import shutil

    npm = shutil.which("npm") or ("/usr/bin/npm" if os.path.exists("/usr/bin/npm") else None)
    if npm is None:
        raise AgentHarnessError("npm not found: install Node.js and npm (Debian: apt-get install nodejs npm)")
    return npm


class NpmAgentHarness(AgentHarness):
    """Base of harnesses whose CLI is an npm package shipping a native executable (no Node.js needed to run it).

    :meth:`prepare` installs ``NPM_PACKAGE@version`` with the host's npm into
    ``agents_cache_dir()/NAME/<version>/`` once (``vime agent prepare NAME``). :meth:`install` then finds the
    executable inside the sandbox, in this order: under :data:`~vime_core.sandbox.base.SANDBOX_AGENTS_DIR` (docker
    mounts the cache there read-only, ``localvm`` shares it there read-only over 9p), at its host path (the ``local``
    backend sees the host's filesystem), else it copies the executable (and :attr:`EXTRA_PATH`) into the sandbox's
    ``/tmp`` (backends without a shared filesystem, e.g. ``localvm`` in attach mode or with an old image; hundreds
    of MB per sandbox).

    :param version: npm version to use (default :attr:`DEFAULT_VERSION`, pinned so that runs are reproducible).
    """

    NPM_PACKAGE: ClassVar[str] = ""
    DEFAULT_VERSION: ClassVar[str] = ""
    #: path of the executable relative to the prepared directory
    EXECUTABLE: ClassVar[str] = ""
    #: directories (relative to the prepared directory) to put on the agent's PATH
    EXTRA_PATH: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, version: str | None = None) -> None:
        self.version = version or self.DEFAULT_VERSION
        self._exe: dict[str, str] = {}  # sandbox id -> executable path inside it

    # -- host side -------------------------------------------------------------------------------------------
    def prepared_dir(self) -> Path:
        """``agents_cache_dir()/NAME/<version>`` (the npm prefix holding ``node_modules/``)."""
        return agents_cache_dir() / self.NAME / self.version

    def is_prepared(self) -> bool:
        return (self.prepared_dir() / ".complete").exists() and (self.prepared_dir() / self.EXECUTABLE).is_file()

    def prepare(self, *, force: bool = False, log: Any = print) -> Path:
        """Install the CLI from the npm registry into the cache (idempotent; ``force`` reinstalls).

        Runs ``npm install --prefix <tmp> NPM_PACKAGE@version``, checks that ``<executable> --version`` runs, then
        moves the directory into place atomically.

        :returns: the prepared directory.
        :raises AgentHarnessError: npm is missing, the install failed, or the executable does not run.
        """
        import shutil
        import subprocess
        import tempfile

        dest = self.prepared_dir()
        if self.is_prepared() and not force:
            log(f"{self.NAME}: {self.NPM_PACKAGE}@{self.version} prepared at {dest}")
            return dest
        npm = npm_executable()
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.version}-", dir=dest.parent))
        try:
            spec = f"{self.NPM_PACKAGE}@{self.version}"
            log(f"{self.NAME}: npm install {spec} into {dest}")
            proc = subprocess.run(
                [npm, "install", "--no-audit", "--no-fund", "--no-save", "--prefix", str(tmp), spec],
                capture_output=True,
                text=True,
                timeout=900,
            )
            if proc.returncode != 0:
                tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
                raise AgentHarnessError(f"npm install {spec} failed ({proc.returncode}):\n{tail}")
            exe = tmp / self.EXECUTABLE
            if not exe.is_file():
                raise AgentHarnessError(f"npm install {spec}: {self.EXECUTABLE} is missing (platform package?)")
            check = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=120)
            if check.returncode != 0:
                raise AgentHarnessError(f"{exe} --version failed: {(check.stdout + check.stderr)[-500:]}")
            (tmp / ".complete").write_text(f"{spec}\n{check.stdout.strip()}\n")
            if dest.exists():
                shutil.rmtree(dest)
            tmp.rename(dest)
            log(f"{self.NAME}: prepared {spec} ({check.stdout.strip()})")
            return dest
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    # -- sandbox side ----------------------------------------------------------------------------------------
    async def install(self, sandbox: Sandbox) -> None:
        """Find (or copy) the prepared executable in ``sandbox``; see the class docstring.

        :raises AgentHarnessError: not prepared on the host (run ``vime agent prepare NAME``), or it cannot be
            run inside the sandbox.
        """
        if sandbox.sandbox_id in self._exe:
            return
        if not self.is_prepared():
            raise AgentHarnessError(
                f"{self.NAME} {self.version} is not prepared on this host: run `vime agent prepare {self.NAME}`"
            )
        rel = f"{self.NAME}/{self.version}/{self.EXECUTABLE}"
        for root in (SANDBOX_AGENTS_DIR, str(self.prepared_dir().parent.parent)):
            r = await sandbox.exec(
                ["/bin/sh", "-c", 'test -x "$1" && "$1" --version', "sh", f"{root}/{rel}"], timeout=120
            )
            if r.exit_code == 0:
                self._exe[sandbox.sandbox_id] = f"{root}/{rel}"
                return
        target = f"/tmp/.vime-agents/{self.NAME}-{self.version}"
        exe = self.prepared_dir() / self.EXECUTABLE
        try:
            await sandbox.write_file(f"{target}/{Path(self.EXECUTABLE).name}", exe.read_bytes(), mode=0o755)
            for extra in self.EXTRA_PATH:
                await sandbox.upload_dir(self.prepared_dir() / extra, f"{target}/{extra}")
        except OSError as e:
            raise AgentHarnessError(f"cannot copy {self.NAME} into the {sandbox.NAME} sandbox: {e}") from e
        path = f"{target}/{Path(self.EXECUTABLE).name}"
        r = await sandbox.exec([path, "--version"], timeout=120)
        if r.exit_code != 0:
            raise AgentHarnessError(f"{self.NAME} does not run in the {sandbox.NAME} sandbox: {r.stderr[-500:]}")
        self._exe[sandbox.sandbox_id] = path

    async def run(
        self, sandbox: Sandbox, *, prompt: str, endpoint: AgentEndpoint, budget: AgentBudget, cwd: str | None = None
    ) -> AgentRunResult:
        """Run the CLI once: :meth:`install`, a fresh :meth:`run_home` that :meth:`prepare_home` fills, the
        :meth:`launch` command killed at ``budget.wall_time_s`` (status ``timeout``); :meth:`read_output` parses
        what it printed and :meth:`end_status` names how it ended (no output it understands: ``error``, after
        :meth:`raise_if_not_started`).

        :raises AgentHarnessError: the CLI is not installed in the sandbox or could not start.
        """
        await self.install(sandbox)
        home = self.run_home()
        await self.prepare_home(sandbox, endpoint, home)
        argv, env, workdir = self.launch(sandbox, prompt, endpoint, budget, home, cwd)
        t0 = time.monotonic()
        r = await sandbox.exec(argv, timeout=budget.wall_time_s, env=env, cwd=workdir)
        duration = time.monotonic() - t0
        output, final, meta = self.read_output(r, argv)
        if r.timed_out:
            status: AgentEndStatus = "timeout"
        elif output is None:
            self.raise_if_not_started(r)
            status = "error"
        else:
            status = self.end_status(r, output)
        return AgentRunResult(status, r.exit_code, duration, final, r.stdout, r.stderr, meta)

    @abc.abstractmethod
    async def prepare_home(self, sandbox: Sandbox, endpoint: AgentEndpoint, home: str) -> None:
        """Create the run's ``home`` in ``sandbox`` (and the configuration the CLI reads from it).

        :raises AgentHarnessError: it cannot be written.
        """

    @abc.abstractmethod
    def launch(
        self, sandbox: Sandbox, prompt: str, endpoint: AgentEndpoint, budget: AgentBudget, home: str, cwd: str | None
    ) -> tuple[list[str], dict[str, str], str | None]:
        """The run's ``(argv, environment, working directory)`` (after :meth:`install`)."""

    @abc.abstractmethod
    def read_output(self, r: ExecResult, argv: list[str]) -> tuple[Any, str, dict[str, Any]]:
        """What the run of ``argv`` printed: ``(parsed output, or None when there is none the harness understands;
        the final message; the result's metadata)``."""

    @abc.abstractmethod
    def end_status(self, r: ExecResult, output: Any) -> AgentEndStatus:
        """How a run that was not killed and printed ``output`` (:meth:`read_output`) ended."""

    def run_home(self) -> str:
        """A fresh per-run directory path in the sandbox for the CLI's home and configuration,
        ``/tmp/.vime-agent/<NAME>-<12 hex digits>`` (under ``/tmp``, so nothing of the agent's lands in the
        workspace); not created here."""
        return f"/tmp/.vime-agent/{self.NAME}-{uuid.uuid4().hex[:12]}"

    def raise_if_not_started(self, r: ExecResult) -> None:
        """For a run that produced no output the harness understands.

        :raises AgentHarnessError: the exit code (127) or the end of stderr (``not found``) says the CLI did not
            start; otherwise returns (the agent started and failed: status ``error``).
        """
        if r.exit_code == 127 or "not found" in r.stderr[-300:]:
            raise AgentHarnessError(f"{self.NAME} did not start (exit {r.exit_code}): {r.stderr[-500:]}")

    def executable(self, sandbox: Sandbox) -> str:
        """The executable's path inside ``sandbox`` (after :meth:`install`)."""
        return self._exe[sandbox.sandbox_id]

    def extra_path(self, sandbox: Sandbox) -> list[str]:
        """:attr:`EXTRA_PATH` directories as seen inside ``sandbox``."""
        exe = self.executable(sandbox)
        base = exe[: -len(self.EXECUTABLE)] if exe.endswith(self.EXECUTABLE) else exe.rsplit("/", 1)[0] + "/"
        return [base + p for p in self.EXTRA_PATH]
