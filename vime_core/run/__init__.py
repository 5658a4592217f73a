"""The driver of ``vime run`` and ``vime eval``: the up-front checks (:mod:`.preflight`), the loop (:mod:`.loop`)
and, beside it, the run's state, setup phases, step source and debug replay, one step, the checkpoint schedule,
what a failed step saves and the evaluations; what a run writes (:mod:`.output_dir`, :mod:`.checkpoint`,
:mod:`.metrics`, :mod:`.summary`, :mod:`.report`), how it shows progress and how it ends on a signal. It resolves
every plugin name the run uses and hands the classes down; it never imports the CLI.
"""
