"""Built-in generate functions (``default``: one engine call; ``multi_turn``: a tool loop) and their flags."""

from vime_core.hookspecs import hookimpl


@hookimpl
def vime_register_generate_functions(register):
    from vime_core.rollout.generate import generate
    from vime_core.rollout.multi_turn import generate as multi_turn

    register("default", generate)
    register("multi_turn", multi_turn)


@hookimpl
def vime_add_arguments(parser):
    from vime_core.rollout.multi_turn import add_arguments

    add_arguments(parser)


@hookimpl
def vime_on_rollout_end(args, samples, metrics):
    if getattr(args, "generate", None) == "multi_turn":
        from vime_core.rollout.multi_turn import rollout_metrics

        metrics.update(rollout_metrics(samples))
