"""elasticctl, the operator's command line.

elasticctl reports every error itself, in one line; gRPC's C core would also print its own
log lines for some of them (a TLS file it cannot use), so they are off unless asked for.
"""

import os

os.environ.setdefault("GRPC_VERBOSITY", "NONE")
