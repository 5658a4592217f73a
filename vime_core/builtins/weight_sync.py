"""Built-in weight-sync strategies and their flags."""

from vime_core.hookspecs import hookimpl


@hookimpl
def vime_register_weight_sync_strategies(register):
    # imported when the hook runs, not with the module: the strategies import torch
    from vime_core.weight_sync.disk import DiskWeightSync
    from vime_core.weight_sync.disk_delta import DiskDeltaWeightSync
    from vime_core.weight_sync.ipc import IpcWeightSync
    from vime_core.weight_sync.nccl import NcclWeightSync

    register(DiskWeightSync.NAME, DiskWeightSync)
    register(DiskDeltaWeightSync.NAME, DiskDeltaWeightSync)
    register(NcclWeightSync.NAME, NcclWeightSync)
    register(IpcWeightSync.NAME, IpcWeightSync)
