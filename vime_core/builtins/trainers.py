"""Built-in trainer backends."""

from vime_core.hookspecs import hookimpl


@hookimpl
def vime_register_trainer_backends(register):
    from vime_core.trainer.torch_backend import TorchTrainer

    register(TorchTrainer.NAME, TorchTrainer)
