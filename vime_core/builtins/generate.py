"""Built-in generate functions (``default``: one engine call; ``multi_turn``: a tool loop; ``coding_agent``: an agent
CLI in a sandbox behind the agent gateway) and their flags."""

from vime_core.hookspecs import hookimpl
from vime_core.rollout import coding_agent, multi_turn
from vime_core.rollout.generate import generate


@hookimpl
def vime_register_generate_functions(register):
    register("default", generate)
    register("multi_turn", multi_turn.generate)
    register("coding_agent", coding_agent.generate)


@hookimpl
def vime_on_rollout_end(ctx, samples, metrics):
    generate = ctx.rollout.generate
    if generate == "multi_turn":
        metrics.update(multi_turn.rollout_metrics(samples))
    elif generate == "coding_agent":
        metrics.update(coding_agent.rollout_metrics(samples))
