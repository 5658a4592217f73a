"""Built-in sandbox backend ``local`` (see :mod:`vime_core.sandbox.local`) and the generic ``--sandbox*`` flags
every backend reads through :meth:`vime_core.sandbox.Sandbox.from_context`."""

from vime_core.plugins.hookspecs import hookimpl
from vime_core.sandbox.local import LocalSandbox


@hookimpl
def vime_register_sandbox_backends(register):
    register(LocalSandbox.NAME, LocalSandbox)
