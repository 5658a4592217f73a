"""vime plugin sandbox-docker: sandboxes as docker containers (:class:`vime_sandbox_docker.sandbox.DockerSandbox`)."""
