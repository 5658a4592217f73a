"""The contract-test kit: pytest base classes every plugin (ours and third parties') runs against itself.

Usage (in a plugin's ``tests/``)::

    from vime_core.testing import RewardFunctionContract

    class TestMyReward(RewardFunctionContract):
        @pytest.fixture
        def reward_fn(self):
            return my_reward

        @pytest.fixture
        def cases(self):
            return [(Sample(response="42", label="42"), 1.0), (Sample(response="7", label="42"), 0.0)]

Rules:

* A subclass supplies the fixtures a contract documents; it may declare ``capabilities`` (a set of strings) that
  turn inapplicable tests into **skips with a reason** — never silent drops.
* A subclass must not override or delete a contract test; to opt out it marks an override
  ``@pytest.mark.xfail(reason=...)``. ``test_no_overrides`` enforces this (langchain-tests' rule).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from vime_core.arguments import complete_args, default_args, flags_without_help
from vime_core.config import RolloutConfig
from vime_core.rewards.call import validate_reward
from vime_core.types import RolloutBatch, Sample, Status

VALID_STATUSES = {Status.COMPLETED, Status.TRUNCATED, Status.ABORTED, Status.FAILED}


class _Contract:
    """Common machinery: capability skips and the no-override guard."""

    capabilities: ClassVar[set[str]] = set()

    def require(self, capability: str) -> None:
        """Skip (with the reason printed) unless the subclass declared ``capability``."""
        if capability not in self.capabilities:
            pytest.skip(f"{type(self).__name__} does not declare capability {capability!r}")

    def test_no_overrides(self) -> None:
        """Contract tests may be overridden only when marked ``xfail(reason=...)``."""
        base = next(c for c in type(self).__mro__ if c.__module__ == __name__ and c is not _Contract)
        for name, member in inspect.getmembers(base, inspect.isfunction):
            if not name.startswith("test_"):
                continue
            impl = getattr(type(self), name)
            if impl is not member:
                marks = [m for m in getattr(impl, "pytestmark", []) if m.name == "xfail" and m.kwargs.get("reason")]
                assert marks, f"{type(self).__name__}.{name} overrides a contract test without xfail(reason=...)"


# ---------------------------------------------------------------------------------------------------------------
# Plugin command-line flags
# ---------------------------------------------------------------------------------------------------------------


class PluginArgumentsContract(_Contract):
    """A plugin's ``vime_add_arguments`` flags: every flag has a help string (what it does, its unit, which other
    flag it interacts with; ``--help`` appends the default), and adding them to a fresh parser works.

    Fixture: ``add_arguments`` — the plugin's ``vime_add_arguments`` hook implementation (called as
    ``add_arguments(parser)``).
    """

    def _parser(self, add_arguments) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog="vime run", allow_abbrev=False)
        add_arguments(parser)
        return parser

    def test_adds_flags(self, add_arguments) -> None:
        """The hook adds at least one flag (a plugin without flags needs no ``vime_add_arguments``)."""
        assert [a for a in self._parser(add_arguments)._actions if a.option_strings and a.dest != "help"]

    def test_every_flag_has_help(self, add_arguments) -> None:
        """No flag without a help string (``vime run --help`` and ``vime args`` print it)."""
        assert flags_without_help(self._parser(add_arguments)) == []

    def test_defaults_parse(self, add_arguments) -> None:
        """Parsing no flags gives every flag its default (no required plugin flag: a run without the plugin's
        component must not need it)."""
        parser = self._parser(add_arguments)
        args = parser.parse_args([])
        for a in parser._actions:
            if a.option_strings and a.dest != "help":
                assert getattr(args, a.dest) == a.default, a.option_strings[0]


# ---------------------------------------------------------------------------------------------------------------
class RewardFunctionContract(_Contract):
    """Contract of ``vime_register_reward_functions`` providers.

    Fixtures to supply: ``reward_fn`` (the async function) and ``cases``: a list of ``(Sample, expected)`` with
    exact expected values (float, or dict for dict rewards). Optional fixtures: ``reward_args`` (a Namespace; the flags
    it lacks take their defaults, :func:`vime_core.arguments.complete_args`) and
    ``error_cases``: samples the reward must refuse by raising (a missing label, a malformed row); the rollout
    manager then marks them failed (``reward_error``) instead of scoring them.
    """

    @pytest.fixture
    def reward_args(self) -> argparse.Namespace:
        return default_args()

    @pytest.fixture
    def error_cases(self) -> list[Sample]:
        return []

    def test_is_async_with_args_sample(self, reward_fn: Any) -> None:
        assert inspect.iscoroutinefunction(reward_fn), "a reward function must be `async def reward(args, sample)`"
        params = list(inspect.signature(reward_fn).parameters)
        assert params[:2] == ["args", "sample"], f"parameters must start with (args, sample), got {params}"

    def test_exact_values(self, reward_fn: Any, cases: list[tuple[Sample, Any]], reward_args) -> None:
        assert cases, "supply at least one (sample, expected) case"
        for sample, expected in cases:
            got = asyncio.run(reward_fn(complete_args(reward_args), sample))
            assert isinstance(got, (float, int, dict)), f"reward must be a float or dict, got {type(got).__name__}"
            validate_reward(got)  # finite, as the rollout manager requires (else the sample would fail)
            assert got == pytest.approx(expected), f"{sample.response!r}: expected {expected}, got {got}"

    def test_error_cases_raise(self, reward_fn: Any, error_cases: list[Sample], reward_args) -> None:
        if not error_cases:
            pytest.skip(f"{type(self).__name__} supplies no error_cases")
        for sample in error_cases:
            with pytest.raises(Exception):  # noqa: B017 - any exception: the manager classifies it
                asyncio.run(reward_fn(complete_args(reward_args), sample))


# ---------------------------------------------------------------------------------------------------------------
class GroupRewardFunctionContract(_Contract):
    """Contract of ``vime_register_group_reward_functions`` providers.

    Fixtures to supply: ``group_reward_fn`` (the async function) and ``group_cases``: a list of
    ``(list[Sample], expected)`` where ``expected`` holds one exact score per sample, in order. Optional fixture
    ``reward_args`` (a Namespace).
    """

    @pytest.fixture
    def reward_args(self) -> argparse.Namespace:
        return default_args()

    def test_is_async_with_args_group(self, group_reward_fn: Any) -> None:
        assert inspect.iscoroutinefunction(group_reward_fn), "a group reward must be `async def fn(args, group)`"
        params = list(inspect.signature(group_reward_fn).parameters)
        assert params[:2] == ["args", "group"], f"parameters must start with (args, group), got {params}"

    def test_exact_values(self, group_reward_fn: Any, group_cases: list[tuple[list[Sample], list[Any]]], reward_args):
        assert group_cases, "supply at least one (group, expected) case"
        for group, expected in group_cases:
            got = asyncio.run(group_reward_fn(complete_args(reward_args), list(group)))
            assert isinstance(got, (list, tuple)) and len(got) == len(group), f"one score per sample, got {got!r}"
            assert list(got) == pytest.approx(list(expected)), f"expected {expected}, got {got}"

    def test_scores_follow_their_samples(self, group_reward_fn: Any, group_cases, reward_args) -> None:
        """Reversing the group reverses the scores: a score belongs to its sample, not to a position."""
        for group, expected in group_cases:
            got = asyncio.run(group_reward_fn(complete_args(reward_args), list(reversed(group))))
            assert list(got) == pytest.approx(list(reversed(expected)))


# ---------------------------------------------------------------------------------------------------------------
class WeightSyncContract(_Contract):
    """Contract of ``vime_register_weight_sync_strategies`` providers.

    Fixture to supply: ``strategy`` (an instance ready to :meth:`push`/:meth:`read`, a fresh one per test).
    Capabilities: ``"cleanup"``: :meth:`cleanup` removes what an update left behind; ``"timeout"``:
    :meth:`apply` talks to a :class:`vime_core.rollout.engine.VLLMServer` over HTTP and raises ``TimeoutError``
    when it does not answer within ``timeout_s``; ``"delta"``: versions are incremental (:meth:`read` applies
    them to a receiver held by the strategy, in order, verified, retry-safe; ``payload["path"]`` holds the files).
    """

    @staticmethod
    def reference_tensors() -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        return {
            "model.embed_tokens.weight": torch.randn(64, 32, generator=g),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16),
            "model.layers.0.mlp.up_proj.weight": torch.randn(48, 32, generator=g).to(torch.float16),
            "model.norm.weight": torch.tensor([1.0, -0.0, float("inf"), 1e-38] * 8),
            "buffer.int": torch.arange(10, dtype=torch.int64),
        }

    def test_round_trip_is_bit_exact(self, strategy: Any) -> None:
        sent = self.reference_tensors()
        update = strategy.push(iter(sent.items()), 1)
        got = strategy.read(update)
        assert sorted(got) == sorted(sent)
        for name, t in sent.items():
            r = got[name]
            assert r.dtype == t.dtype and r.shape == t.shape, name
            assert torch.equal(r.view(torch.uint8), t.contiguous().view(torch.uint8)), f"{name} differs bitwise"

    def test_version_bytes_seconds(self, strategy: Any) -> None:
        sent = self.reference_tensors()
        update = strategy.push(iter(sent.items()), 7)
        assert update.version == 7
        assert update.num_bytes >= sum(t.numel() * t.element_size() for t in sent.values()) or update.num_bytes > 0
        assert update.seconds >= 0.0

    def test_cleanup(self, strategy: Any) -> None:
        self.require("cleanup")
        update = strategy.push(iter(self.reference_tensors().items()), 2)
        strategy.cleanup(update)
        with pytest.raises(Exception):  # noqa: B017 - any error: the update is gone
            strategy.read(update)

    # -- appended: timeouts and delta semantics (capabilities "timeout", "delta") ----------------------------------
    @staticmethod
    def changed_tensors(base: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
        """``base`` after a small update: a few elements of some tensors change, ``model.norm.weight`` does not."""
        out = {n: t.clone() for n, t in base.items()}
        out["model.embed_tokens.weight"][step % 64, :4] += 1e-3 * step
        out["model.layers.0.self_attn.q_proj.weight"][:, step % 32] *= 1.0 + 2**-6
        out["model.layers.0.mlp.up_proj.weight"][step % 48] = -out["model.layers.0.mlp.up_proj.weight"][step % 48]
        out["buffer.int"][step % 10] += step
        return out

    @staticmethod
    def assert_bit_exact(got: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> None:
        assert sorted(got) == sorted(sent)
        for name, t in sent.items():
            r = got[name]
            assert r.dtype == t.dtype and r.shape == t.shape, name
            assert torch.equal(r.reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)), name

    def test_apply_times_out_on_a_receiver_that_never_answers(self, strategy: Any) -> None:
        """``apply`` on an engine whose server accepts connections but never answers raises ``TimeoutError``
        within about ``timeout_s`` (capability ``"timeout"``; the engine is a real
        :class:`vime_core.rollout.engine.VLLMServer` client pointed at a silent socket)."""
        self.require("timeout")
        import time

        from vime_core.rollout.engine import VLLMServer

        update = strategy.push(iter(self.reference_tensors().items()), 1)
        with _SilentServer() as port:
            engine = VLLMServer("unused", port=port, request_timeout_s=120.0)
            try:
                t0 = time.monotonic()
                with pytest.raises(TimeoutError, match="within"):
                    strategy.apply(engine, update, timeout_s=1.0)
                assert time.monotonic() - t0 < 10.0
            finally:
                engine._http.close()

    def test_delta_versions_are_bit_exact_and_small(self, strategy: Any) -> None:
        """Successive versions round-trip bit-exactly and a small change moves fewer bytes than the first version
        (capability ``"delta"``)."""
        self.require("delta")
        sent = self.reference_tensors()
        first = strategy.push(iter(sent.items()), 1)
        self.assert_bit_exact(strategy.read(first), sent)
        for version in (2, 3):
            sent = self.changed_tensors(sent, version)
            update = strategy.push(iter(sent.items()), version)
            assert update.version == version
            assert 0 < update.num_bytes < first.num_bytes
            self.assert_bit_exact(strategy.read(update), sent)

    def test_out_of_order_delta_is_refused(self, strategy: Any) -> None:
        """Reading version N+2 on a receiver at version N fails and changes nothing; in order, both apply
        (capability ``"delta"``)."""
        self.require("delta")
        t1 = self.reference_tensors()
        strategy.read(strategy.push(iter(t1.items()), 1))
        t2 = self.changed_tensors(t1, 2)
        t3 = self.changed_tensors(t2, 3)
        u2 = strategy.push(iter(t2.items()), 2)
        u3 = strategy.push(iter(t3.items()), 3)
        with pytest.raises(Exception, match="(?i)order|version"):
            strategy.read(u3)
        self.assert_bit_exact(strategy.read(u2), t2)
        self.assert_bit_exact(strategy.read(u3), t3)

    def test_retry_after_an_interrupted_delta(self, strategy: Any) -> None:
        """A version whose files were cut short (an interrupted transfer) or had a byte flipped is refused and
        leaves the receiver on its old version; once the files are whole again the same version applies
        bit-exactly, and applying it once more is harmless (capability ``"delta"``; ``payload["path"]`` is the
        directory of the version's files)."""
        self.require("delta")
        t1 = self.reference_tensors()
        strategy.read(strategy.push(iter(t1.items()), 1))
        t2 = self.changed_tensors(t1, 2)
        u2 = strategy.push(iter(t2.items()), 2)
        files = [f for f in sorted(Path(u2.payload["path"]).rglob("*")) if f.is_file()]
        assert files, "a delta update must leave files under payload['path']"
        saved = {f: f.read_bytes() for f in files}
        for f, data in saved.items():  # interrupted: every file cut in half
            f.write_bytes(data[: len(data) // 2])
        with pytest.raises(Exception):  # noqa: B017 - any error, as long as nothing is applied
            strategy.read(u2)
        for f, data in saved.items():  # corrupted: the last payload byte flipped
            f.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
        with pytest.raises(Exception, match="(?i)checksum|corrupt"):
            strategy.read(u2)
        for f, data in saved.items():
            f.write_bytes(data)
        self.assert_bit_exact(strategy.read(u2), t2)
        self.assert_bit_exact(strategy.read(u2), t2)  # a retry of an applied version changes nothing
        t3 = self.changed_tensors(t2, 3)
        self.assert_bit_exact(strategy.read(strategy.push(iter(t3.items()), 3)), t3)


class _SilentServer:
    """A TCP listener on 127.0.0.1 that accepts connections and never answers (a hung receiver); yields its port."""

    def __enter__(self) -> int:
        import socket
        import threading

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.conns: list[Any] = []
        self.closed = threading.Event()

        def accept() -> None:
            while not self.closed.is_set():
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                self.conns.append(conn)

        threading.Thread(target=accept, daemon=True).start()
        return int(self.sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.closed.set()
        for c in self.conns:
            c.close()
        self.sock.close()


# ---------------------------------------------------------------------------------------------------------------
class TrainerBackendContract(_Contract):
    """Contract of ``vime_register_trainer_backends`` providers.

    Fixture to supply: ``trainer`` — a backend instance on a small model, built with ``lr`` large enough that
    one step visibly changes log-probs, ``global_batch_size=None`` and ``weight_decay=0``. Also ``tmp_path``.
    """

    @staticmethod
    def make_batch(vocab: int, advantage: float) -> RolloutBatch:
        g = torch.Generator().manual_seed(1)
        samples, advs = [], []
        for i in range(2):
            prompt = torch.randint(0, vocab, (5,), generator=g).tolist()
            s = Sample(group_index=0, index=i, tokens=prompt, status=Status.COMPLETED, reward=1.0)
            resp = torch.randint(0, vocab, (4,), generator=g).tolist()
            s.append_response_tokens(resp, trainable=True, log_probs=[-1.0] * 4, weight_version=0)
            samples.append(s)
            advs.append([advantage] * 4)
        return RolloutBatch(samples=samples, advantages=advs)

    def _vocab(self, trainer: Any) -> int:
        return int(dict(trainer.named_hf_tensors())["model.embed_tokens.weight"].shape[0])

    def _lp(self, trainer: Any, batch: RolloutBatch) -> float:
        from vime_core.algorithms.logprobs import token_log_probs

        tot = 0.0
        for s in batch.samples:
            ids = torch.tensor([s.tokens])
            with torch.no_grad():
                lp = token_log_probs(trainer.model(input_ids=ids).logits, ids)[0, s.prompt_length - 1 :]
            tot += float(lp.sum())
        return tot

    def test_hf_tensor_names(self, trainer: Any) -> None:
        names = [n for n, _ in trainer.named_hf_tensors()]
        assert "model.embed_tokens.weight" in names and len(names) == len(set(names))

    def test_zero_advantage_changes_nothing(self, trainer: Any) -> None:
        before = {n: t.clone() for n, t in trainer.named_hf_tensors()}
        trainer.train_step(self.make_batch(self._vocab(trainer), 0.0))
        after = dict(trainer.named_hf_tensors())
        assert all(torch.equal(before[n], after[n]) for n in before)

    def test_positive_advantage_raises_log_probs(self, trainer: Any) -> None:
        batch = self.make_batch(self._vocab(trainer), 1.0)
        before = self._lp(trainer, batch)
        metrics = trainer.train_step(batch)
        assert self._lp(trainer, batch) > before
        assert "train/pg_loss" in metrics and "train/grad_norm" in metrics

    def test_checkpoint_round_trip(self, trainer: Any, tmp_path: Path) -> None:
        trainer.save_checkpoint(tmp_path / "ck")
        saved = {n: t.clone() for n, t in trainer.named_hf_tensors()}
        trainer.train_step(self.make_batch(self._vocab(trainer), 1.0))
        trainer.load_checkpoint(tmp_path / "ck")
        now = dict(trainer.named_hf_tensors())
        assert all(torch.equal(saved[n], now[n]) for n in saved)


# ---------------------------------------------------------------------------------------------------------------
class GenerateFunctionContract(_Contract):
    """Contract of ``vime_register_generate_functions`` providers (needs a running rollout context).

    Fixtures to supply: ``generate_fn``, ``generate_args`` (a Namespace with what the function reads; the flags it
    lacks take their defaults, :func:`vime_core.arguments.complete_args`),
    ``prompt_sample`` (a fresh :class:`Sample`) and ``rollout_context`` (an installed
    :class:`vime_core.rollout.context.RolloutContext`, e.g. a real router client + tokenizer).
    """

    def _run(self, generate_fn, generate_args, sample, params) -> list[Sample]:
        out = asyncio.run(generate_fn(complete_args(generate_args), sample, params))
        return out if isinstance(out, list) else [out]

    def test_signature(self, generate_fn: Any) -> None:
        assert inspect.iscoroutinefunction(generate_fn)
        assert list(inspect.signature(generate_fn).parameters)[:3] == ["args", "sample", "sampling_params"]

    def test_sample_bookkeeping(self, generate_fn, generate_args, prompt_sample, rollout_context) -> None:
        params = {"temperature": 1.0, "max_tokens": 8}
        for s in self._run(generate_fn, generate_args, prompt_sample, params):
            s.validate()
            assert s.status in VALID_STATUSES
            assert len(s.loss_mask) == s.response_length == len(s.rollout_log_probs) == len(s.weight_versions)
            assert 1 <= s.response_length <= 8 or s.status in (Status.ABORTED, Status.FAILED)
            assert all(lp <= 0.0 for lp, m in zip(s.rollout_log_probs, s.loss_mask, strict=True) if m)
            assert all(
                v == rollout_context.weight_version for v, m in zip(s.weight_versions, s.loss_mask, strict=True) if m
            )

    def test_tokens_are_prompt_plus_response(self, generate_fn, generate_args, prompt_sample, rollout_context):
        from vime_core.rollout.generate import encode_prompt

        apply_chat_template = RolloutConfig.from_args(complete_args(generate_args)).apply_chat_template
        prompt_ids = encode_prompt(rollout_context.tokenizer, prompt_sample.prompt, apply_chat_template)
        for s in self._run(generate_fn, generate_args, prompt_sample, {"temperature": 1.0, "max_tokens": 4}):
            assert s.tokens[: s.prompt_length] == prompt_ids


# ---------------------------------------------------------------------------------------------------------------
class SandboxBackendContract(_Contract):
    """Contract of ``vime_register_sandbox_backends`` providers (:class:`vime_core.sandbox.Sandbox` subclasses).

    Fixtures to supply:

    * ``sandbox_factory``: ``factory(**kwargs) -> Sandbox`` (not started; used as ``async with factory() as sb``),
      accepting the :class:`~vime_core.sandbox.Sandbox` keywords ``limits``, ``network`` and ``env``;
    * ``sandbox_exists``: ``fn(sandbox) -> bool``: whether any resource of that sandbox (process, container, VM,
      directory) still exists, asked of the backend's service directly, not of the object.

    Optional fixture ``sabotage``: ``async fn(sandbox)`` that destroys the sandbox behind vime's back (kills its
    VM, removes its container); without it the infrastructure-error test is skipped.

    Capabilities (see :data:`vime_core.sandbox.CAPABILITIES`): ``network_isolation``, ``resource_limits``,
    ``filesystem_isolation``, ``user``, ``detached``, ``wall_time``, ``reaper``, ``host_port``. The sandbox image
    must have ``/bin/sh``, coreutils, ``tar`` and ``python3``.
    """

    #: interfaces in ``/proc/net/dev`` of a sandbox without network; ``None`` skips that check (a VM keeps a
    #: restricted NIC for its SSH port forward). The outbound-connection check runs regardless.
    isolated_interfaces: ClassVar[set[str] | None] = {"lo"}

    @staticmethod
    def _run(coro: Any) -> Any:
        return asyncio.run(coro)

    @pytest.fixture
    def sabotage(self) -> Any:
        return None

    # -- registration and exec -----------------------------------------------------------------------------------
    def test_is_a_sandbox_class(self, sandbox_factory: Any) -> None:
        from vime_core.sandbox import Sandbox

        sb = sandbox_factory()
        assert isinstance(sb, Sandbox) and type(sb).NAME, "a backend subclasses vime_core.sandbox.Sandbox with NAME"
        assert sb.sandbox_id.startswith("vime-")

    def test_exec_exit_code_stdout_stderr(self, sandbox_factory: Any) -> None:
        async def body():
            async with sandbox_factory() as sb:
                r = await sb.exec("printf 'out\\n'; printf 'err\\n' >&2; exit 3", timeout=30)
                assert (r.exit_code, r.stdout, r.stderr, r.timed_out, r.truncated) == (
                    3,
                    "out\n",
                    "err\n",
                    False,
                    False,
                )
                ok = await sb.exec(["printf", "%s|", "a b", "c"], timeout=30)
                assert (ok.exit_code, ok.stdout, ok.ok) == (0, "a b|c|", True)
                assert (await sb.exec("kill -9 $$", timeout=30)).exit_code == 137

        self._run(body())

    def test_exec_env_cwd_stdin(self, sandbox_factory: Any) -> None:
        async def body():
            async with sandbox_factory(env={"BASE": "1"}) as sb:
                r = await sb.exec('printf "%s,%s" "$BASE" "$FOO"', env={"FOO": "bar baz"}, timeout=30)
                assert r.stdout == "1,bar baz"
                assert (await sb.exec("mkdir -p sub/dir", timeout=30)).exit_code == 0
                r = await sb.exec("pwd", cwd=f"{sb.workspace}/sub/dir", timeout=30)
                assert r.stdout == f"{sb.workspace}/sub/dir\n"
                assert (await sb.exec("pwd", timeout=30)).stdout == f"{sb.workspace}\n"
                blob = bytes(range(256)) * 1000
                r = await sb.exec("cat | wc -c", stdin=blob, timeout=30)
                assert r.stdout.strip() == str(len(blob))

        self._run(body())

    def test_exec_timeout(self, sandbox_factory: Any) -> None:
        import time

        from vime_core.sandbox import TIMEOUT_EXIT_CODE

        async def body():
            async with sandbox_factory() as sb:
                t0 = time.monotonic()
                r = await sb.exec("echo started; sleep 60", timeout=1.0)
                took = time.monotonic() - t0
                assert (r.timed_out, r.exit_code) == (True, TIMEOUT_EXIT_CODE)
                assert 0.9 <= took < 15, f"timeout of 1 s took {took:.1f} s"
                assert (await sb.exec("echo alive", timeout=30)).stdout == "alive\n"

        self._run(body())

    def test_output_flood_is_truncated(self, sandbox_factory: Any) -> None:
        async def body():
            async with sandbox_factory() as sb:
                r = await sb.exec(
                    "head -c 3000000 /dev/zero | tr '\\0' a; head -c 3000 /dev/zero | tr '\\0' b >&2",
                    timeout=60,
                    max_output_bytes=1000,
                )
                assert (r.exit_code, r.stdout, r.stdout_truncated) == (0, "a" * 1000, True)
                assert (r.stderr, r.stderr_truncated) == ("b" * 1000, True)
                r = await sb.exec("printf 12345", timeout=30, max_output_bytes=5)
                assert (r.stdout, r.stdout_truncated) == ("12345", False)

        self._run(body())

    def test_concurrent_execs(self, sandbox_factory: Any) -> None:
        async def body():
            async with sandbox_factory() as sb:
                rs = await asyncio.gather(*(sb.exec(f"sleep 0.2; echo {i}", timeout=60) for i in range(6)))
                assert [r.stdout for r in rs] == [f"{i}\n" for i in range(6)]

        self._run(body())

    # -- files ---------------------------------------------------------------------------------------------------
    def test_write_read_round_trip_is_byte_exact(self, sandbox_factory: Any) -> None:
        blob = bytes(range(256)) * 4096 + b"\x00\xff"

        async def body():
            async with sandbox_factory() as sb:
                await sb.write_file("nested/dir/data.bin", blob)
                assert await sb.read_file("nested/dir/data.bin") == blob
                assert await sb.read_file(f"{sb.workspace}/nested/dir/data.bin") == blob
                await sb.write_file("empty", b"")
                assert await sb.read_file("empty") == b""
                await sb.write_file("text.txt", "héllo\n")
                assert (await sb.exec("cat text.txt", timeout=30)).stdout == "héllo\n"
                await sb.exec("printf 'from inside' > made.txt", timeout=30)
                assert await sb.read_file("made.txt") == b"from inside"
                with pytest.raises(FileNotFoundError):
                    await sb.read_file("missing.txt")
                with pytest.raises(IsADirectoryError):
                    await sb.read_file("nested")

        self._run(body())

    def test_upload_download_dir(self, sandbox_factory: Any, tmp_path: Path) -> None:
        src = tmp_path / "src"
        (src / "a" / "b").mkdir(parents=True)
        (src / "top.txt").write_text("top\n")
        (src / "a" / "b" / "bin.dat").write_bytes(bytes(range(256)) * 10)
        (src / "a" / "empty").write_bytes(b"")

        async def body():
            async with sandbox_factory() as sb:
                await sb.upload_dir(src, "proj")
                r = await sb.exec("cat proj/top.txt; wc -c < proj/a/b/bin.dat", timeout=30)
                assert r.stdout.split() == ["top", "2560"]
                await sb.exec("echo new > proj/a/new.txt", timeout=30)
                await sb.download_dir("proj", tmp_path / "back")
                with pytest.raises(FileNotFoundError):
                    await sb.download_dir("no-such-dir", tmp_path / "none")

        self._run(body())
        back = tmp_path / "back"
        files = sorted(str(p.relative_to(back)) for p in back.rglob("*") if p.is_file())
        assert files == ["a/b/bin.dat", "a/empty", "a/new.txt", "top.txt"]
        assert (back / "a" / "b" / "bin.dat").read_bytes() == bytes(range(256)) * 10
        assert (back / "a" / "new.txt").read_text() == "new\n"

    def test_sandboxes_do_not_share_files(self, sandbox_factory: Any) -> None:
        async def body():
            async with sandbox_factory() as one, sandbox_factory() as two:
                await one.write_file("mine.txt", b"1")
                assert (await two.exec("test -e mine.txt", timeout=30)).exit_code != 0
                if "filesystem_isolation" in self.capabilities:  # a private /tmp too
                    await one.exec("echo x > /tmp/vime-shared-probe", timeout=30)
                    assert (await two.exec("test -e /tmp/vime-shared-probe", timeout=30)).exit_code != 0

        self._run(body())

    # -- isolation -----------------------------------------------------------------------------------------------
    _NET_PROBE = (
        "import socket\n"
        "try:\n"
        "    socket.create_connection(('1.1.1.1', 53), timeout=3)\n"
        "    print('connected')\n"
        "except OSError as e:\n"
        "    print('blocked', type(e).__name__)\n"
    )

    def test_network_off_by_default(self, sandbox_factory: Any) -> None:
        self.require("network_isolation")

        async def body():
            async with sandbox_factory() as sb:
                r = await sb.exec("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '", timeout=30)
                if self.isolated_interfaces is not None:
                    assert set(r.stdout.split()) == self.isolated_interfaces, f"interfaces: {r.stdout.split()}"
                r = await sb.exec(["python3", "-c", self._NET_PROBE], timeout=30)
                assert r.stdout.startswith("blocked"), r.stdout + r.stderr
            async with sandbox_factory(network=True) as sb:
                r = await sb.exec("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '", timeout=30)
                assert set(r.stdout.split()) - {"lo"}, "network=True gives the sandbox an interface besides lo"

        self._run(body())

    def test_cannot_write_outside_workspace(self, sandbox_factory: Any) -> None:
        self.require("filesystem_isolation")
        import os

        probe = "/etc/vime-sandbox-escape-probe"

        async def body():
            async with sandbox_factory() as sb:
                for target in (probe, "/usr/vime-escape", "/vime-escape"):
                    r = await sb.exec(f"echo x > {target}", timeout=30)
                    assert r.exit_code != 0, f"wrote {target}"
                with pytest.raises(PermissionError):
                    await sb.write_file(probe, b"x")
                assert (
                    await sb.exec("echo ok > inside.txt && echo ok > /tmp/t && cat inside.txt", timeout=30)
                ).stdout == "ok\n"
                assert (await sb.exec(f"test -e {probe}", timeout=30)).exit_code != 0

        self._run(body())
        assert not os.path.exists(probe)

    def test_resource_limits(self, sandbox_factory: Any) -> None:
        self.require("resource_limits")
        from vime_core.sandbox import SandboxLimits

        limits = SandboxLimits(memory_bytes=128 << 20, pids=32, disk_bytes=8 << 20, cpus=1.0)

        async def body():
            async with sandbox_factory(limits=limits) as sb:
                mem = await sb.exec(["python3", "-c", "b = bytearray(512 << 20); print('allocated')"], timeout=60)
                assert mem.exit_code != 0 and "allocated" not in mem.stdout, "512 MiB allocated under 128 MiB"
                big = await sb.exec("head -c 16000000 /dev/zero > big.bin", timeout=60)
                assert big.exit_code != 0, "16 MB file written under an 8 MB disk limit"
                forks = await sb.exec("for i in $(seq 1 64); do sleep 2 & done; wait", timeout=60)
                assert forks.exit_code != 0 or forks.stderr, "64 processes started under pids=32"
                assert (await sb.exec("echo still-usable", timeout=30)).stdout == "still-usable\n"

        self._run(body())

    def test_wall_time_limit_kills_everything(self, sandbox_factory: Any) -> None:
        self.require("wall_time")
        import time

        from vime_core.sandbox import SandboxExpiredError, SandboxLimits

        async def body():
            async with sandbox_factory(limits=SandboxLimits(wall_time_s=3.0)) as sb:
                t0 = time.monotonic()
                r = await sb.exec("sleep 60", timeout=60)
                assert r.timed_out and time.monotonic() - t0 < 20
                await asyncio.sleep(0.5)
                with pytest.raises(SandboxExpiredError):
                    await sb.exec("true", timeout=30)

        self._run(body())  # and the teardown after expiry does not raise

    def test_user(self, sandbox_factory: Any) -> None:
        self.require("user")

        async def body():
            async with sandbox_factory() as sb:
                assert (await sb.exec("id -u", user="nobody", timeout=30)).stdout == "65534\n"

        self._run(body())

    # -- detached commands ---------------------------------------------------------------------------------------
    def test_detached_start_poll_wait_kill(self, sandbox_factory: Any) -> None:
        self.require("detached")

        async def body():
            async with sandbox_factory() as sb:
                proc = await sb.start_detached(
                    "until [ -f go ]; do sleep 0.05; done; echo done; echo warn >&2; exit 4"
                )
                assert await sb.poll(proc) is None
                await sb.write_file("go", b"")
                r = await sb.wait(proc, timeout=60)
                assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (4, "done\n", "warn\n", False)
                long = await sb.start_detached("sleep 60")
                await sb.kill(long)
                r = await sb.wait(long, timeout=30)
                assert r.exit_code == 137
                limited = await sb.start_detached("sleep 60", timeout=1.0)
                r = await sb.wait(limited, timeout=30)
                assert (r.timed_out, r.exit_code) == (True, 137)

        self._run(body())

    # -- host port -----------------------------------------------------------------------------------------------
    _HTTP_GET = (
        "import sys, urllib.request\n"
        "try:\n"
        "    body = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode()\n"
        "    print('ok', body)\n"
        "except Exception as e:\n"
        "    print('failed', type(e).__name__)\n"
    )

    def test_expose_host_port(self, sandbox_factory: Any) -> None:
        """A host HTTP server on 127.0.0.1 answers a request made from inside the sandbox through
        ``expose_host_port``; with ``network_isolation``, another host port stays unreachable (capability
        ``"host_port"``)."""
        self.require("host_port")
        import http.server
        import threading

        def serve(body: bytes) -> http.server.ThreadingHTTPServer:
            class Handler(http.server.BaseHTTPRequestHandler):
                def do_GET(self) -> None:  # noqa: N802
                    payload = body + self.path.encode()
                    self.send_response(200)
                    self.send_header("content-length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)

                def log_message(self, *a: Any) -> None:
                    pass

            srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            return srv

        exposed, hidden = serve(b"exposed:"), serve(b"hidden:")
        port, other = exposed.server_address[1], hidden.server_address[1]

        async def body():
            async with sandbox_factory() as sb:
                addr = await sb.expose_host_port(port)
                assert await sb.expose_host_port(port) == addr, "exposing the same port twice gives one address"
                for path in ("/a", "/b/c"):
                    r = await sb.exec(["python3", "-c", self._HTTP_GET, f"http://{addr}{path}"], timeout=60)
                    assert r.stdout == f"ok exposed:{path}\n", r.stdout + r.stderr
                if "network_isolation" in self.capabilities:
                    host, _, _ = addr.rpartition(":")
                    r = await sb.exec(["python3", "-c", self._HTTP_GET, f"http://{host}:{other}/x"], timeout=60)
                    assert r.stdout.startswith("failed"), r.stdout + r.stderr
                    r = await sb.exec(["python3", "-c", self._NET_PROBE], timeout=30)
                    assert r.stdout.startswith("blocked"), r.stdout + r.stderr

        try:
            self._run(body())
        finally:
            exposed.shutdown()
            hidden.shutdown()

    # -- teardown ------------------------------------------------------------------------------------------------
    def test_teardown_on_exception(self, sandbox_factory: Any, sandbox_exists: Any) -> None:
        holder: list[Any] = []

        async def body():
            async with sandbox_factory() as sb:
                holder.append(sb)
                await sb.exec("sleep 60 > /dev/null 2>&1 &", timeout=30)
                assert sandbox_exists(sb)
                raise KeyError("boom")

        with pytest.raises(KeyError):
            self._run(body())
        assert not sandbox_exists(holder[0])

    def test_teardown_on_cancellation_and_timeout(self, sandbox_factory: Any, sandbox_exists: Any) -> None:
        from vime_core.sandbox import SandboxExpiredError

        holder: list[Any] = []
        started = asyncio.Event

        async def use(ev: asyncio.Event) -> None:
            sb = sandbox_factory()
            holder.append(sb)
            async with sb:
                ev.set()
                await sb.exec("sleep 60", timeout=120)

        async def body():
            ev = started()
            task = asyncio.ensure_future(use(ev))
            await asyncio.wait_for(ev.wait(), 120)
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            ev2 = started()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(use(ev2), timeout=4.0)

        self._run(body())
        assert len(holder) == 2
        for sb in holder:
            assert not sandbox_exists(sb), f"{sb.sandbox_id} survived cancellation"
            with pytest.raises(SandboxExpiredError):
                asyncio.run(sb.exec("true"))

    def test_infrastructure_failure_raises_infra_error(self, sandbox_factory: Any, sabotage: Any) -> None:
        if sabotage is None:
            pytest.skip(f"{type(self).__name__} supplies no `sabotage` fixture")
        from vime_core.sandbox import SandboxInfraError

        async def body():
            async with sandbox_factory() as sb:
                await sabotage(sb)
                with pytest.raises(SandboxInfraError):
                    await sb.exec("true", timeout=30)

        self._run(body())

    def test_reaper_spares_live_sandboxes(self, sandbox_factory: Any) -> None:
        self.require("reaper")

        async def body():
            async with sandbox_factory() as sb:
                report = await asyncio.to_thread(type(sb).cleanup)
                assert sb.sandbox_id not in report.removed
                assert (await sb.exec("echo alive", timeout=30)).stdout == "alive\n"

        self._run(body())


# ---------------------------------------------------------------------------------------------------------------
class AgentHarnessContract(_Contract):
    """Contract of ``vime_register_agent_harnesses`` providers (:class:`vime_core.agent.harness.AgentHarness`).

    The kit runs the harness **for real**: a real :class:`~vime_core.agent.gateway.AgentGateway` on 127.0.0.1 backed
    by a :class:`~vime_core.agent.responders.ScriptedResponder` (the kit's tiny model tokenizer; the fixed assistant
    turns come from the plugin), a real sandbox from the plugin's factory with the gateway exposed inside
    (:meth:`~vime_core.sandbox.base.Sandbox.expose_host_port`), the agent CLI run through :meth:`AgentHarness.run`.

    Fixtures to supply:

    * ``harness``: an :class:`~vime_core.agent.harness.AgentHarness` instance, prepared on the host;
    * ``sandbox_factory``: ``factory(**kwargs) -> Sandbox`` (not started) of a backend with capability
      ``host_port``;
    * ``write_file_turns``: ``fn(path, content) -> list[str]``: the raw assistant turns (Hermes
      ``<tool_call>{json}</tool_call>`` format, the gateway's default parser) that make this agent write ``content``
      to ``path`` (relative to its working directory) with its own tools and then finish with a text answer;
    * ``sleep_turns``: ``fn(seconds) -> list[str]``: turns that make the agent run ``sleep <seconds>``.

    Checked with exact values: the file exists with exactly ``content``; the agent made exactly the scripted calls;
    the session's Samples train exactly the scripted turns' tokens (``loss_mask`` 1 exactly there, log-probs and
    versions as scripted, every trained token sampled in that context); status ``completed``; the wall-time budget
    kills a sleeping agent (``timeout``); the turn budget stops a looping agent (``max_turns``).
    """

    MODEL: ClassVar[str] = "vime-policy"
    PROMPT: ClassVar[str] = "Create the file requested by the task and then stop."
    #: seconds a contract episode may take (the CLIs start in a few seconds)
    EPISODE_WALL_S: ClassVar[float] = 240.0

    @pytest.fixture(scope="class")
    @classmethod
    def agent_tokenizer(cls, tmp_path_factory: pytest.TempPathFactory) -> Any:
        from transformers import AutoTokenizer

        from vime_core.testing.tiny_model import build_tiny_model

        d = build_tiny_model(tmp_path_factory.getbasetemp() / "vime-kit-agent-tiny", seed=0)
        return AutoTokenizer.from_pretrained(str(d))

    @staticmethod
    def _run(coro: Any) -> Any:
        return asyncio.run(coro)

    def _episode(self, harness, sandbox_factory, tok, turns, budget, read: str | None = None) -> dict[str, Any]:
        """One real episode; returns the run result, the file read back, the backend, turns and samples."""
        import uuid

        from vime_core.agent.gateway import AgentGateway
        from vime_core.agent.harness import AgentEndpoint
        from vime_core.agent.responders import ScriptedResponder

        backend = ScriptedResponder(tok, list(turns))
        gw = AgentGateway(tok, backend, served_model_name=self.MODEL).start()
        sid = f"sk-vime-kit-{uuid.uuid4().hex[:12]}"
        out: dict[str, Any] = {"backend": backend}

        async def body() -> None:
            async with sandbox_factory() as sb:
                addr = await sb.expose_host_port(gw.port)
                endpoint = AgentEndpoint(f"http://{addr}", sid, self.MODEL)
                await harness.install(sb)
                out["result"] = await harness.run(sb, prompt=self.PROMPT, endpoint=endpoint, budget=budget)
                if read is not None:
                    try:
                        out["file"] = await sb.read_file(read)
                    except FileNotFoundError:
                        out["file"] = None

        try:
            gw.open_session(sid, sampling_params={"max_tokens": budget.max_tokens}, max_turns=budget.max_turns)
            self._run(body())
            out["turns"] = gw.session_turns(sid)
            out["samples"] = gw.close_session(sid, Sample(prompt=self.PROMPT))
        finally:
            gw.stop()
        return out

    def test_is_an_agent_harness(self, harness: Any) -> None:
        from vime_core.agent.harness import AgentHarness

        assert isinstance(harness, AgentHarness) and type(harness).NAME, "a harness subclasses AgentHarness with NAME"
        assert harness.api in ("anthropic", "openai-chat", "openai-responses")

    def test_scripted_episode_writes_file_token_exact(
        self, harness: Any, sandbox_factory: Any, agent_tokenizer: Any, write_file_turns: Any
    ) -> None:
        from vime_core.agent.harness import AgentBudget
        from vime_core.agent.trajectory import check_token_exact

        content = "vime contract: the agent wrote this\nline 2\n"
        turns = write_file_turns("answer.txt", content)
        budget = AgentBudget(max_turns=len(turns) + 2, max_tokens=512, wall_time_s=self.EPISODE_WALL_S)
        ep = self._episode(harness, sandbox_factory, agent_tokenizer, turns, budget, read="answer.txt")
        res, backend, samples = ep["result"], ep["backend"], ep["samples"]
        assert res.status == "completed" and res.exit_code == 0, (res.status, res.exit_code, res.stderr[-2000:])
        assert ep["file"] == content.encode(), ep["file"]
        assert len(backend.calls) == len(turns), f"{len(backend.calls)} model calls for {len(turns)} scripted turns"
        expected = [t for turn in turns for t in backend.turn_ids(turn)[0]]
        trained = [s.tokens[s.prompt_length + i] for s in samples for i, m in enumerate(s.loss_mask) if m == 1]
        assert trained == expected, "the trained tokens are exactly the scripted turns' tokens"
        lps = [s.rollout_log_probs[i] for s in samples for i, m in enumerate(s.loss_mask) if m == 1]
        assert lps == [-0.5] * len(expected)
        assert all(set(s.loss_mask) <= {0, 1} and len(s.loss_mask) == s.response_length for s in samples)
        assert len({s.rollout_id for s in samples}) == 1 and samples[0].rollout_id
        assert all(s.status == Status.COMPLETED and not s.remove_sample for s in samples)
        check_token_exact(samples, ep["turns"])

    def test_wall_time_budget_kills_the_agent(
        self, harness: Any, sandbox_factory: Any, agent_tokenizer: Any, sleep_turns: Any
    ) -> None:
        from vime_core.agent.harness import AgentBudget

        turns = sleep_turns(600)
        budget = AgentBudget(max_turns=len(turns) + 2, max_tokens=512, wall_time_s=10.0)
        ep = self._episode(harness, sandbox_factory, agent_tokenizer, turns, budget)
        res = ep["result"]
        assert res.status == "timeout", (res.status, res.exit_code, res.stdout[-1000:], res.stderr[-1000:])
        assert res.duration_s < budget.wall_time_s + 60

    def test_turn_budget_stops_the_agent(
        self, harness: Any, sandbox_factory: Any, agent_tokenizer: Any, write_file_turns: Any
    ) -> None:
        from vime_core.agent.harness import AgentBudget

        tool_turns = write_file_turns("loop.txt", "again\n")[:-1]
        budget = AgentBudget(max_turns=2, max_tokens=512, wall_time_s=self.EPISODE_WALL_S)
        ep = self._episode(harness, sandbox_factory, agent_tokenizer, tool_turns * 6, budget)
        res = ep["result"]
        assert res.status == "max_turns", (res.status, res.exit_code, res.stdout[-1500:], res.stderr[-1000:])
        assert len(ep["backend"].calls) == 2
