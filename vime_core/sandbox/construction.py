"""How a sandbox backend is built for a run: from the run's typed configuration (``from_context`` →
``from_config(sandbox section, the backend's own flags)``), and the deprecated ``from_args`` of vime 0.x. A base
of :class:`~vime_core.sandbox.base.Sandbox`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Self

from vime_core.config import SandboxConfig
from vime_core.sandbox.limits import backend_kwargs, sandbox_kwargs_from_config


class SandboxConstruction:
    """The constructors of a sandbox from configuration; the keywords they pass go to the backend's ``__init__``."""

    #: the backend's own flag class (a :class:`~vime_core.config.PluginConfig` registered through
    #: ``vime_register_flags``), ``None`` for a backend without flags of its own
    FLAGS: ClassVar[type | None] = None
    #: the backend's own flags given to the constructor: field of :attr:`FLAGS` → constructor keyword (a flag left
    #: unset, ``None`` or empty, is left out, so the constructor's default applies)
    FLAG_KWARGS: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def from_config(cls, sandbox: SandboxConfig | None = None, flags: Any = None, **kwargs: Any) -> Self:
        """Build a sandbox from the run's typed configuration. Keywords win.

        :param sandbox: the generic ``--sandbox-*`` limits (:func:`~vime_core.sandbox.limits.sandbox_kwargs`);
            ``None``: the constructor's defaults.
        :param flags: the backend's :attr:`FLAGS` instance, read through :attr:`FLAG_KWARGS`; ``None``: defaults.
        """
        return cls(**{**sandbox_kwargs_from_config(sandbox), **backend_kwargs(flags, cls.FLAG_KWARGS), **kwargs})

    @classmethod
    def from_context(cls, ctx: Any, **kwargs: Any) -> Self:
        """Build a sandbox for a run from its :class:`~vime_core.config.context.PluginContext`: :meth:`from_config` of
        its sandbox section and the backend's own flags (``ctx.plugin(FLAGS)``). Keywords win.

        A backend written for vime 0.x (it overrides :meth:`from_args` only, or declares :attr:`FLAG_KWARGS`
        without :attr:`FLAGS`) is built by its ``from_args`` from the run's Namespace, with a
        ``DeprecationWarning``.
        """
        from vime_core.config.context import legacy_args, overrides_from_args_only, warn_built_from_args

        legacy = cls.FLAGS is None and bool(cls.FLAG_KWARGS)  # 0.x: FLAG_KWARGS names attributes of the Namespace
        if legacy or overrides_from_args_only(cls, SandboxConstruction):
            warn_built_from_args(cls, "sandbox backend", "from_config(sandbox, flags, **kwargs)")
            return cls.from_args(legacy_args(ctx.config), **kwargs)
        own = ctx.plugin(cls.FLAGS) if cls.FLAGS is not None else None
        return cls.from_config(ctx.sandbox, own, **kwargs)

    @classmethod
    def from_args(cls, args: Any, **kwargs: Any) -> Self:
        """Deprecated, goes in vime 0.2 (use :meth:`from_context` or :meth:`from_config`): build a sandbox from a
        ``vime run`` Namespace, or ``None`` for the defaults. Keywords win. Still what builds a backend written for
        vime 0.1 that overrides it alone (:meth:`from_context` warns then)."""
        sandbox = SandboxConfig.from_args(args) if args is not None and hasattr(args, "sandbox_cpus") else None
        if cls.FLAGS is not None:
            own = cls.FLAGS.from_args(args)  # type: ignore[attr-defined]
        else:
            own = args  # a 0.x backend: FLAG_KWARGS names attributes of the Namespace
        return cls.from_config(sandbox, own, **kwargs)
