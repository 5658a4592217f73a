"""Built-in generate functions."""

from vime_core.hookspecs import hookimpl


@hookimpl
def vime_register_generate_functions(register):
    from vime_core.rollout.generate import generate

    register("default", generate)
