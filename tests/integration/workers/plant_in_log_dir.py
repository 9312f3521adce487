"""A hostile job (it runs as the job's user): in its first attempt it replaces something in its
own log directory that the root daemon reads, then fails, so that torchrun restarts the worker
group and the daemon looks again.

    plant_in_log_dir.py LOG_DIR fifo            agent.log becomes a FIFO
    plant_in_log_dir.py LOG_DIR link TARGET     agent.log becomes a symlink to TARGET
    plant_in_log_dir.py LOG_DIR torchrun TARGET torchrun/ becomes a symlink to TARGET, and the
                                                worker then sleeps (no restart)
"""

import os
import sys
import time

log_dir, mode = sys.argv[1], sys.argv[2]
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if attempt == 0:
    if mode == "torchrun":
        here = os.path.join(log_dir, "torchrun")
        os.rename(here, here + ".moved")
        os.symlink(sys.argv[3], here)
        print("planted torchrun ->", sys.argv[3], flush=True)
        time.sleep(300)
    log = os.path.join(log_dir, "agent.log")
    os.unlink(log)  # the agent and its workers keep writing to the file they have open
    if mode == "fifo":
        os.mkfifo(log)
    else:
        os.symlink(sys.argv[3], log)
raise RuntimeError(f"attempt {attempt} failed on purpose")
