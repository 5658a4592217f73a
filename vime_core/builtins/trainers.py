"""Built-in trainer backends and the Megatron flags of the ``megatron`` backend."""

import argparse

from vime_core.hookspecs import hookimpl


@hookimpl
def vime_register_trainer_backends(register):
    # imported when the hook runs, not with the module: the backends import torch (and megatron-core)
    from vime_core.trainer.megatron_backend import MegatronTrainer
    from vime_core.trainer.torch_backend import TorchTrainer

    register(TorchTrainer.NAME, TorchTrainer)
    register(MegatronTrainer.NAME, MegatronTrainer)


@hookimpl
def vime_add_arguments(parser):
    """Megatron's own flag names (as in Megatron-LM), read by ``--trainer megatron``."""
    g = parser.add_argument_group("megatron (--trainer megatron; Megatron-LM's flag names)")
    g.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="Megatron tensor parallel size (ranks that split each layer); needs that many GPUs per trainer",
    )
    g.add_argument(
        "--pipeline-model-parallel-size", type=int, default=1, help="Megatron pipeline parallel size (only 1 yet)"
    )
    g.add_argument("--context-parallel-size", type=int, default=1, help="Megatron context parallel size (only 1 yet)")
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Megatron sequence parallelism (with --tensor-model-parallel-size > 1)",
    )
    g.add_argument(
        "--recompute-granularity",
        choices=["full", "selective"],
        default=None,
        help="Megatron activation recomputation: full layers or selective (attention core); default: none",
    )
    g.add_argument(
        "--recompute-method",
        choices=["uniform", "block"],
        default=None,
        help="with --recompute-granularity full: uniform (every N layers) or block (the first N layers per stage)",
    )
    g.add_argument(
        "--recompute-num-layers",
        type=int,
        default=None,
        help="N of --recompute-method (layers; default: Megatron's)",
    )
    g.add_argument(
        "--use-distributed-optimizer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="shard the optimizer state over data-parallel ranks (Megatron's distributed optimizer)",
    )
    g.add_argument(
        "--megatron-attention",
        choices=["te", "sdpa", "local"],
        default=None,
        help="core attention: Transformer Engine spec (default when TE imports), torch SDPA in the local "
        "spec (default otherwise), or Megatron's unfused local attention",
    )
