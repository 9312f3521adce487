"""The per-node daemon: main loop, HTTP endpoint, process entry point."""

# Before anything imports grpc: the daemon forks children as the job's user (see that module).
import elasticd.coordination.grpc_fork  # noqa: F401
