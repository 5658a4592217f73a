"""vime plugin sandbox-e2b: sandboxes on E2B through the official ``e2b`` SDK (:class:`E2BSandbox`)."""

from vime_sandbox_e2b.sandbox import E2BSandbox

__all__ = ["E2BSandbox"]
