"""Every hook is documented in docs/hooks.md with its exact signature and has a test named after it."""

import dataclasses
import inspect
from pathlib import Path

import pytest

from tests.support.rollout import manager_with_hooks
from vime_core import hookimpl
from vime_core.cli.arguments import build_parser, build_run_config
from vime_core.config import ConfigError, PluginConfig, flag
from vime_core.plugins import hookspecs
from vime_core.plugins.manager import Plugins
from vime_core.plugins.registry import RegistryError
from vime_core.testing.plugin_context import plugin_context
from vime_core.types import Sample, Status

pytestmark = pytest.mark.unit
HOOKS = sorted(n for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if n.startswith("vime_"))
DOCS = (Path(__file__).parents[2] / "docs" / "hooks.md").read_text()


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_documented_with_its_signature(name):
    params = [p for p in inspect.signature(getattr(hookspecs, name)).parameters if p != "args"]  # deprecated
    sig = f"{name}({', '.join(params)})"
    assert f"`{sig}`" in DOCS, f"docs/hooks.md lacks `{sig}`"


@pytest.mark.parametrize("name", HOOKS)
def test_hook_has_a_test(name):
    tests = set(globals())
    assert f"test_hook_{name}" in tests, f"no test_hook_{name} in {__file__}"


def _plugins_with(plugin) -> Plugins:
    p = Plugins()
    p.pm.register(plugin, name="test-plugin")
    return p.load()


class _Obj:
    pass


def _registration_case(hook_name, kind, obj):
    ns = {}

    def impl(register):
        register("from-test", obj)

    impl.__name__ = hook_name
    ns[hook_name] = hookimpl(impl)
    plugin = type("P", (), {hook_name: staticmethod(ns[hook_name])})
    plugins = _plugins_with(plugin)
    assert plugins.resolve(kind, "from-test") is obj
    entry = next(e for e in plugins.registries[kind].entries() if e.name == "from-test")
    assert entry.provider == "test-plugin"


async def _gen(ctx, sample, sampling_params):
    return sample


async def _rew(ctx, sample):
    return 1.0


def test_hook_vime_register_generate_functions():
    _registration_case("vime_register_generate_functions", "generate", _gen)


def test_hook_vime_register_reward_functions():
    _registration_case("vime_register_reward_functions", "reward", _rew)


def test_hook_vime_register_group_reward_functions():
    """Registered like the others (a wrong signature is refused); scoring through the rollout manager is in
    tests/unit/test_reward_failures.py, the built-in ``rank`` in the contract kit."""

    async def by_group(ctx, group):
        return [1.0] * len(group)

    _registration_case("vime_register_group_reward_functions", "group_reward", by_group)

    where = "plugin 'test-plugin' (?) registers group_reward 'from-test' = "
    lam = f"{__name__}.test_hook_vime_register_group_reward_functions.<locals>.<lambda>"
    with pytest.raises(RegistryError) as e:
        _registration_case("vime_register_group_reward_functions", "group_reward", lambda ctx: None)
    assert str(e.value) == f"{where}{lam}: expected async def (ctx, group), found def (ctx)"
    with pytest.raises(RegistryError) as e:
        _registration_case("vime_register_group_reward_functions", "group_reward", lambda ctx, group: None)
    assert str(e.value) == f"{where}{lam}: expected async def (ctx, group), found def (ctx, group)"


def test_hook_vime_register_advantage_estimators():
    def est(ctx, group):
        return [[0.0] * s.response_length for s in group]

    _registration_case("vime_register_advantage_estimators", "advantage", est)


def test_hook_vime_register_dynamic_sampling_filters():
    def keep_all(ctx, group):
        return True

    _registration_case("vime_register_dynamic_sampling_filters", "dynamic_filter", keep_all)
    from vime_core.algorithms.filters import check_reward_nonzero_std

    assert Plugins().load().resolve("dynamic_filter", "check_reward_nonzero_std") is check_reward_nonzero_std


def test_hook_vime_register_sandbox_backends():
    from vime_core.sandbox.local import LocalSandbox

    _registration_case(
        "vime_register_sandbox_backends", "sandbox", type("FromTest", (LocalSandbox,), {"NAME": "from-test"})
    )
    with pytest.raises(RegistryError) as e:  # registered under another name than its NAME
        _registration_case("vime_register_sandbox_backends", "sandbox", type("FromTest", (LocalSandbox,), {}))
    assert str(e.value).endswith(
        "its NAME is 'local'; a class registers under its own NAME (register(FromTest.NAME, FromTest), or set "
        "NAME = 'from-test')"
    )


def test_hook_vime_register_agent_harnesses():
    from vime_core.agent.harness import AgentHarness

    class Harness(AgentHarness):
        NAME = "from-test"

        async def install(self, sandbox):
            pass

        async def run(self, sandbox, *, prompt, endpoint, budget, cwd=None):
            raise NotImplementedError

    _registration_case("vime_register_agent_harnesses", "agent", Harness)
    with pytest.raises(RegistryError) as e:  # checked like every other kind
        _registration_case("vime_register_agent_harnesses", "agent", _Obj)
    assert str(e.value) == (
        f"plugin 'test-plugin' (?) registers agent 'from-test' = {__name__}._Obj: "
        f"expected a subclass of vime_core.agent.harness.AgentHarness, found {__name__}._Obj"
    )


def test_hook_vime_register_weight_sync_strategies():
    from vime_core.weight_sync.disk import DiskWeightSync

    class Strategy(DiskWeightSync):
        NAME = "from-test"

    _registration_case("vime_register_weight_sync_strategies", "weight_sync", Strategy)


def test_hook_vime_register_trainer_backends():
    from vime_core.trainer.torch_backend import TorchTrainer

    class Backend(TorchTrainer):
        NAME = "from-test"

    _registration_case("vime_register_trainer_backends", "trainer", Backend)


def test_hook_vime_add_arguments(monkeypatch):
    """The deprecated hook still adds its flags, and registering it warns naming its replacement."""

    class P:
        @staticmethod
        @hookimpl
        def vime_add_arguments(parser):
            parser.add_argument_group("test-plugin").add_argument("--test-plugin-level", type=int, default=3)

    with pytest.warns(DeprecationWarning, match="vime_register_flags"):
        plugins = _plugins_with(P)
    monkeypatch.setattr("vime_core.plugins.manager._PLUGINS", plugins)
    args = build_parser().parse_args(["--model", "m", "--test-plugin-level", "5"])
    assert args.test_plugin_level == 5


@dataclasses.dataclass(frozen=True, kw_only=True)
class _LevelFlags(PluginConfig):
    PREFIX = "test-plugin"
    TITLE = "test-plugin"
    test_plugin_level: int = flag(type=int, default=3, help="a level, 0-9")
    test_plugin_names: list[str] = flag(nargs="+", default=["a"], help="names")


def test_hook_vime_register_flags(monkeypatch):
    """A registered flag class becomes flags of the parser (default and help from the field), and the run's typed
    config holds the plugin's values; a class outside its prefix is refused naming the field."""

    class P:
        @staticmethod
        @hookimpl
        def vime_register_flags(register):
            register(_LevelFlags.PREFIX, _LevelFlags)

    plugins = _plugins_with(P)
    assert plugins.flag_classes()[-1] is _LevelFlags  # after the installed plugins' classes
    monkeypatch.setattr("vime_core.plugins.manager._PLUGINS", plugins)
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "test_plugin_level")
    assert (action.default, action.help, action.option_strings) == (3, "a level, 0-9", ["--test-plugin-level"])
    args = parser.parse_args(["--model", "m", "--test-plugin-level", "5"])
    args.vllm_args, args.router_args = [], []
    cfg = build_run_config(args)
    assert cfg.plugin(_LevelFlags) == _LevelFlags(test_plugin_level=5, test_plugin_names=["a"])
    assert _LevelFlags.from_args(None) == _LevelFlags()  # outside vime run: the declared defaults
    with pytest.raises(ConfigError, match=r"holds no \S*_Other flags"):

        @dataclasses.dataclass(frozen=True, kw_only=True)
        class _Other(PluginConfig):
            PREFIX = "other"
            TITLE = "other"

        cfg.plugin(_Other)

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Outside(PluginConfig):
        PREFIX = "test-plugin"
        TITLE = "test-plugin"
        level: int = flag(type=int, default=3, help="a level")

    class Q:
        @staticmethod
        @hookimpl
        def vime_register_flags(register):
            register(Outside.PREFIX, Outside)

    with pytest.raises(RegistryError, match=r"Outside.level: the flag --level is outside the plugin's prefix"):
        _plugins_with(Q)


def test_hook_vime_on_sample(tiny_model_dir, tmp_path):
    seen = []

    class P:
        @staticmethod
        @hookimpl
        def vime_on_sample(sample, step):
            seen.append((sample.group_index, sample.index, step, sample.reward))
            sample.remove_sample = sample.index == 1

    groups, _ = manager_with_hooks(tiny_model_dir, tmp_path, P).generate(5)
    assert sorted(seen) == [(0, 0, 5, 0.0), (0, 1, 5, 0.0), (1, 0, 5, 0.0), (1, 1, 5, 0.0)]
    assert [[s.is_trainable() for s in g] for g in groups] == [[True, False], [True, False]]


def test_hook_vime_on_rollout_end(tiny_model_dir, tmp_path):
    class P:
        @staticmethod
        @hookimpl
        def vime_on_rollout_end(step, samples, metrics):
            metrics["custom/num"] = float(len(samples) + step)

    _, metrics = manager_with_hooks(tiny_model_dir, tmp_path, P).generate(3)
    assert metrics["custom/num"] == 7.0
    assert metrics["rollout/response_len_mean"] == 3.0 and metrics["rollout/reward_mean"] == 0.0


def test_hook_vime_on_train_step_end():
    """Called by the loop after each step; exercised end to end in tests/integration/test_vime_run.py. Here: the
    hook relays the step and metrics it is called with, through pluggy, to every implementation."""
    got = []

    class P:
        @staticmethod
        @hookimpl
        def vime_on_train_step_end(step, metrics):
            got.append((step, dict(metrics)))

    plugins = _plugins_with(P)
    plugins.pm.hook.vime_on_train_step_end(ctx=plugin_context(), step=4, metrics={"train/pg_loss": 0.5}, args=None)
    assert got == [(4, {"train/pg_loss": 0.5})]


def test_dynamic_sampling_filter_refills_until_enough_groups_pass(tiny_model_dir, tmp_path):
    """Rewards come from exact_match against labels; only groups with mixed rewards pass check_reward_nonzero_std.
    The echo generator answers 'x' for even-indexed samples of odd prompts only, so prompts p1 and p3 pass."""

    async def echo(args, sample, sampling_params):
        prompt_no = int(sample.prompt[1:])
        text = "x" if (prompt_no % 2 == 1 and sample.index == 0) else "y"
        sample.tokens = [1, 2]
        sample.append_response_tokens([3], trainable=True, log_probs=[-0.5], weight_version=0, text=text)
        sample.status = sample.status.COMPLETED
        return sample

    m = manager_with_hooks(
        tiny_model_dir,
        tmp_path,
        generate=echo,
        num_prompts=8,
        dynamic_sampling_filter="check_reward_nonzero_std",
        over_sampling_batch_size=3,
        dynamic_sampling_max_rounds=8,
    )
    groups, metrics = m.generate(0)
    # chunk 1 = p0 p1 p2 → p1 passes; chunk 2 = p3 p4 p5 → p3 fills the batch, p5 passes too but is surplus
    assert [g[0].prompt for g in groups] == ["p1", "p3"]
    assert [[s.reward for s in g] for g in groups] == [[1.0, 0.0], [1.0, 0.0]]
    assert metrics["rollout/dynamic_filter_rounds"] == 2.0
    assert metrics["rollout/dynamic_filter_drop_ratio"] == 3 / 6  # p0, p2, p4 dropped of 6 generated
    assert metrics["rollout/dynamic_filter_surplus"] == 1.0  # p5 passed after the batch was full
    assert metrics["rollout/reward_mean"] == 0.5


def test_fan_out_generate_scores_each_rollout_once(tiny_model_dir, tmp_path):
    """A generate function returning a list (segments of one rollout, e.g. ``coding_agent``): the reward function
    is called once per rollout, every segment gets that reward and one shared episode_id, the segments replace the
    sample in its group (in order), and ``vime_on_sample`` sees each segment; a failing rollout stays one failed
    placeholder."""
    calls = []

    async def fan(args, sample, sampling_params):
        if sample.prompt == "p1" and sample.index == 1:
            raise RuntimeError("sandbox died")
        segs = []
        for k in range(1 + sample.index):  # index 0 -> 1 segment, index 1 -> 2 segments
            s = Sample(group_index=sample.group_index, index=sample.index, prompt=sample.prompt, label=sample.label)
            s.tokens = [1, 2]
            s.append_response_tokens([3 + k], trainable=True, log_probs=[-0.5], weight_version=0, text="x")
            s.status = Status.COMPLETED
            segs.append(s)
        return segs

    async def counting_reward(args, sample):
        calls.append((sample.group_index, sample.index))
        sample.metadata["scored"] = True
        return float(sample.index + 1)

    seen = []

    class P:
        @staticmethod
        @hookimpl
        def vime_register_reward_functions(register):
            register("counting", counting_reward)

        @staticmethod
        @hookimpl
        def vime_on_sample(sample, step):
            seen.append((sample.group_index, sample.index, sample.status.value))

    groups, metrics = manager_with_hooks(tiny_model_dir, tmp_path, P, generate=fan, reward="counting").generate(0)
    assert sorted(calls) == [(0, 0), (0, 1), (1, 0)]
    assert [[(s.index, s.status.value, s.reward, s.tokens) for s in g] for g in groups] == [
        [(0, "completed", 1.0, [1, 2, 3]), (1, "completed", 2.0, [1, 2, 3]), (1, "completed", 2.0, [1, 2, 4])],
        [(0, "completed", 1.0, [1, 2, 3]), (1, "failed", None, [])],
    ]
    g0 = groups[0]
    assert g0[1].episode_id == g0[2].episode_id and g0[0].episode_id not in (None, g0[1].episode_id)
    assert g0[2].metadata["scored"] is True  # what the reward wrote on the first segment reaches the others
    assert groups[1][1].metadata["error"] == "RuntimeError: sandbox died"
    assert sorted(seen) == [
        (0, 0, "completed"),
        (0, 1, "completed"),
        (0, 1, "completed"),
        (1, 0, "completed"),
        (1, 1, "failed"),
    ]
    assert metrics["rollout/failed_frac"] == 1 / 5
