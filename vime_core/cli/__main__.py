"""``python -m vime_core.cli``: the ``vime`` command (:func:`vime_core.cli.commands.main`)."""

import sys

from vime_core.cli.commands import main

sys.exit(main())
