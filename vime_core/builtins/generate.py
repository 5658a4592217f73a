"""Built-in generate functions (``default``: one engine call; ``multi_turn``: a tool loop; ``coding_agent``: an agent
CLI in a sandbox behind the agent gateway) and their flags."""

from vime_core.config import RolloutConfig
from vime_core.hookspecs import hookimpl


@hookimpl
def vime_register_generate_functions(register):
    from vime_core.rollout.coding_agent import generate as coding_agent
    from vime_core.rollout.generate import generate
    from vime_core.rollout.multi_turn import generate as multi_turn

    register("default", generate)
    register("multi_turn", multi_turn)
    register("coding_agent", coding_agent)


@hookimpl
def vime_add_arguments(parser):
    from vime_core.rollout.coding_agent import add_arguments as coding_agent_arguments
    from vime_core.rollout.multi_turn import add_arguments

    add_arguments(parser)
    coding_agent_arguments(parser)


@hookimpl
def vime_on_rollout_end(args, samples, metrics):
    generate = RolloutConfig.from_args(args).generate
    if generate == "multi_turn":
        from vime_core.rollout.multi_turn import rollout_metrics

        metrics.update(rollout_metrics(samples))
    elif generate == "coding_agent":
        from vime_core.rollout.coding_agent import rollout_metrics

        metrics.update(rollout_metrics(samples))
