"""A real :class:`~vime_core.rollout.manager.RolloutManager` without engines: its generate function is a plain
coroutine (the tests that use it exercise the manager, the hooks and the data flow, not vLLM)."""

from __future__ import annotations

from vime_core import hookimpl
from vime_core.cli.arguments import default_args
from vime_core.config import RunConfig
from vime_core.plugins.manager import Plugins


async def echo_generate(args, sample, sampling_params):
    """Generate function: prompt tokens ``[1, 2]``, response ``[3, 4, 5]`` (trainable, log-prob -0.5 each)."""
    sample.tokens = [1, 2]
    sample.append_response_tokens([3, 4, 5], trainable=True, log_probs=[-0.5] * 3, weight_version=0)
    sample.status = sample.status.COMPLETED
    return sample


def manager_with_hooks(tiny_model_dir, tmp_path, plugin=None, generate=echo_generate, num_prompts=4, **overrides):
    """A RolloutManager whose generate function needs no engine (``generate``, default: fixed tokens), over
    ``num_prompts`` prompts ``p0..`` labelled ``x``, with ``plugin`` loaded and ``overrides`` applied to the args."""
    import json

    import vime_core.plugins.manager as vp
    from vime_core.rollout.context import RolloutContext, set_rollout_context
    from vime_core.rollout.manager import RolloutManager

    class Gen:
        @staticmethod
        @hookimpl
        def vime_register_generate_functions(register):
            register("echo", generate)

    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"p{i}", "label": "x"}) for i in range(num_prompts)))
    p = Plugins()
    p.pm.register(Gen, name="gen")
    if plugin is not None:
        p.pm.register(plugin, name="test-plugin")
    p.load()
    args = default_args(
        generate="echo",
        reward="exact_match",
        weight_sync="disk",
        prompt_data=data,
        input_key="prompt",
        label_key="label",
        metadata_key="metadata",
        n_samples_per_prompt=2,
        rollout_shuffle=False,
        seed=0,
        rollout_batch_size=2,
        rollout_concurrency=4,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        rollout_top_k=-1,
        rollout_max_response_len=8,
        rollout_stop=None,
        rollout_stop_token_ids=None,
        reward_key=None,
        update_weight_disk_dir=tmp_path / "w",
    )
    vars(args).update(overrides)
    old, vp._PLUGINS = vp._PLUGINS, p
    try:
        m = RolloutManager(RunConfig.from_args(args), tiny_model_dir)
    finally:
        vp._PLUGINS = old
    set_rollout_context(RolloutContext(client=None, tokenizer=m.tokenizer))
    return m
