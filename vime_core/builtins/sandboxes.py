"""Built-in sandbox backend: ``local`` (subprocesses in a fresh directory; see :mod:`vime_core.sandbox.local`)."""

from vime_core.hookspecs import hookimpl


@hookimpl
def vime_register_sandbox_backends(register):
    from vime_core.sandbox.local import LocalSandbox

    register(LocalSandbox.NAME, LocalSandbox)
