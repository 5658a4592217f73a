"""Built-in trainer backends and the Megatron flags of the ``megatron`` backend."""

from vime_core.plugins.hookspecs import hookimpl
from vime_core.plugins.registry import Lazy


@hookimpl
def vime_register_trainer_backends(register):
    # by import path: the backends import torch (and megatron-core), which a flag or name check does not need
    register("torch", Lazy("vime_core.trainer.torch_backend:TorchTrainer"))
    register("megatron", Lazy("vime_core.trainer.megatron_backend:MegatronTrainer"))
