"""Tables for README.md from this directory's sharded restore results (sharded_shm_<tree>_<k>
.json, tree ``new`` = this branch, ``old`` = main fd88171, run k in the hold's order), made by
restore31's summarize.py pointed at this directory; writes summary.json here.

    python bench/results/restore35/summarize.py
"""

import os
import runpy

here = os.path.dirname(os.path.abspath(__file__))
tables = runpy.run_path(os.path.join(here, "..", "restore31", "summarize.py"))
tables["main"].__globals__["HERE"] = here
tables["main"]()
