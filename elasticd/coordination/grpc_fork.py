"""gRPC's fork handlers off in any process that talks to etcd: import this before ``grpc``.

The daemon starts a job's agent, zygote and file check as the job's user. CPython then forks
(vfork is not used when the child changes its uid), and gRPC's fork handlers (the etcd
client's) restart its event-engine threads in the child, which crash there before the exec:
measured here, 6 of 60 such starts died of SIGSEGV while a watch was open, none with this off.
The children only exec, so they need no gRPC. The setting is read when gRPC starts, so it is
made here, by every module that imports ``pyetcd``, and not by the daemon's entry point alone:
a process that imported the etcd client first (a test run, a tool) kept the handlers on, and
its file checks died of SIGSEGV. A value the operator set is kept.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
