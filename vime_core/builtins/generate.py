"""Built-in generate functions (``default``: one engine call; ``multi_turn``: a tool loop; ``coding_agent``: an agent
CLI in a sandbox behind the agent gateway) and their flags."""

from vime_core.plugins.hookspecs import hookimpl
from vime_core.plugins.registry import Lazy
from vime_core.rollout.generators.default import generate


@hookimpl
def vime_register_generate_functions(register):
    register("default", generate)
    # by import path: the tool loop and the agent gateway import FastAPI and the agent APIs (a second at start-up)
    register("multi_turn", Lazy("vime_core.rollout.generators.multi_turn:generate"))
    register("coding_agent", Lazy("vime_core.rollout.generators.coding_agent:generate"))


@hookimpl
def vime_on_rollout_end(ctx, samples, metrics):
    generate = ctx.rollout.generate
    if generate == "multi_turn":
        from vime_core.rollout.generators import multi_turn

        metrics.update(multi_turn.rollout_metrics(samples))
    elif generate == "coding_agent":
        from vime_core.rollout.generators import coding_agent

        metrics.update(coding_agent.rollout_metrics(samples))
