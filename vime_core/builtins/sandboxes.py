"""Built-in sandbox backend ``local`` (see :mod:`vime_core.sandbox.local`) and the generic ``--sandbox*`` flags
every backend reads through :meth:`vime_core.sandbox.Sandbox.from_args`."""

from vime_core.hookspecs import hookimpl
from vime_core.sandbox.local import LocalSandbox


@hookimpl
def vime_register_sandbox_backends(register):
    register(LocalSandbox.NAME, LocalSandbox)


@hookimpl
def vime_add_arguments(parser):
    g = parser.add_argument_group("sandbox (backend chosen by name; limits apply to every backend, 0 = none)")
    g.add_argument("--sandbox", default="local", help="sandbox backend for generate functions that run code")
    g.add_argument("--sandbox-network", action="store_true", help="give sandboxes network access (default: none)")
    g.add_argument("--sandbox-cpus", type=float, default=1.0, help="CPU quota per sandbox, in cores")
    g.add_argument("--sandbox-memory-mb", type=int, default=1024, help="memory per sandbox, MiB")
    g.add_argument("--sandbox-disk-mb", type=int, default=1024, help="disk (or largest file) per sandbox, MiB")
    g.add_argument("--sandbox-pids", type=int, default=512, help="processes per sandbox")
    g.add_argument("--sandbox-wall-time", type=float, default=3600.0, help="lifetime of a sandbox, seconds")
    g.add_argument(
        "--sandbox-max-output-bytes", type=int, default=1 << 20, help="bytes kept of each of stdout/stderr per command"
    )
    g.add_argument("--sandbox-exec-timeout", type=float, default=300.0, help="default command timeout, seconds")
