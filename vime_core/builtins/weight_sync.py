"""Built-in weight-sync strategies."""

from vime_core.hookspecs import hookimpl


@hookimpl
def vime_register_weight_sync_strategies(register):
    from vime_core.weight_sync.disk import DiskWeightSync

    register(DiskWeightSync.NAME, DiskWeightSync)
