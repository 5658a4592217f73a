"""Built-in weight-sync strategies and their flags."""

from vime_core.plugins.hookspecs import hookimpl
from vime_core.plugins.registry import Lazy


@hookimpl
def vime_register_weight_sync_strategies(register):
    # by import path: the strategies import torch, which a flag or name check does not need
    register("disk", Lazy("vime_core.weight_sync.disk:DiskWeightSync"))
    register("disk-delta", Lazy("vime_core.weight_sync.disk_delta:DiskDeltaWeightSync"))
    register("nccl", Lazy("vime_core.weight_sync.nccl:NcclWeightSync"))
    register("ipc", Lazy("vime_core.weight_sync.ipc:IpcWeightSync"))
