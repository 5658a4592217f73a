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


@hookimpl
def vime_add_arguments(parser):
    g = parser.add_argument_group("weight sync: disk-delta")
    g.add_argument(
        "--update-weight-delta-encoding",
        choices=["xor", "sub", "overwrite"],
        default="sub",
        help="disk-delta: xor of old and new bytes, integer difference of each element's bits (both "
        "applied once), or changed byte positions + new bytes",
    )
    g.add_argument("--update-weight-delta-zstd-level", type=int, default=1, help="disk-delta: zstandard level")
    g.add_argument(
        "--update-weight-delta-base",
        default=None,
        help="disk-delta: HF directory the engines start from (the first delta's base); default --model",
    )
    g = parser.add_argument_group("weight sync: nccl")
    g.add_argument(
        "--update-weight-buffer-size",
        type=int,
        default=512 * 2**20,
        help="nccl, ipc: bucket size in bytes (tensors are broadcast in buckets of at most this size; slime's flag)",
    )
    g.add_argument(
        "--update-weight-checksums",
        action="store_true",
        help="nccl: attach an xxh3-128 digest per tensor; receivers verify before loading",
    )
