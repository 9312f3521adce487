"""The per-node daemon: main loop, HTTP endpoint, process entry point."""

import os as _os

# The daemon starts a job's agent and zygote as the job's user. CPython then forks (vfork is
# not used when the child changes its uid), and gRPC's fork handlers (the etcd client's) restart
# its event-engine threads in the child, which crash there before the exec: measured here, 6
# of 60 such starts died of SIGSEGV while a watch was open, none with this off. Set before grpc
# is imported; the child only execs.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
