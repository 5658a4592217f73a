"""vime plugin sandbox-modal: sandboxes on Modal through the official ``modal`` SDK (:class:`ModalSandbox`)."""

from vime_sandbox_modal.sandbox import ModalSandbox

__all__ = ["ModalSandbox"]
