"""Tables for README.md from this directory's sharded restore results (sharded_<pages>_<tree>_<k>
.json, tree ``v7`` = this branch at bc93809, ``base`` = main at 61ae2d7, run k in the holds'
order), made by restore31's summarize.py pointed at this directory; writes summary.json here.

    python bench/results/restore33/summarize.py
"""

import os
import runpy

here = os.path.dirname(os.path.abspath(__file__))
tables = runpy.run_path(os.path.join(here, "..", "restore31", "summarize.py"))
tables["main"].__globals__["HERE"] = here
tables["main"]()
