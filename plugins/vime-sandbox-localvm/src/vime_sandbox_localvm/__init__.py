"""vime plugin sandbox-localvm: sandboxes as QEMU VMs over SSH (see :mod:`vime_sandbox_localvm.sandbox`)."""
