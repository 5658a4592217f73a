"""Built-in weight-sync strategies and their flags."""

from vime_core.hookspecs import hookimpl


@hookimpl
def vime_register_weight_sync_strategies(register):
    from vime_core.weight_sync.disk import DiskWeightSync
    from vime_core.weight_sync.disk_delta import DiskDeltaWeightSync

    register(DiskWeightSync.NAME, DiskWeightSync)
    register(DiskDeltaWeightSync.NAME, DiskDeltaWeightSync)


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
