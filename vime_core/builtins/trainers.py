"""Built-in trainer backends and the Megatron flags of the ``megatron`` backend."""

from vime_core.hookspecs import hookimpl


@hookimpl
def vime_register_trainer_backends(register):
    # imported when the hook runs, not with the module: the backends import torch (and megatron-core)
    from vime_core.trainer.megatron_backend import MegatronTrainer
    from vime_core.trainer.torch_backend import TorchTrainer

    register(TorchTrainer.NAME, TorchTrainer)
    register(MegatronTrainer.NAME, MegatronTrainer)
