"""Tables for README.md from this directory's sharded restore results of hold 2
(sharded_<pages>_<tree>_<k>.json, tree ``1m`` = d467747, ``512k`` = the same with 512 KiB
checksum blocks, run k in the hold's order): restore31's summarize.py (each run beside the
verified floor of the same run, CPU by process, and per (pages, tree) the medians of the three
ratios), run on this directory. Writes summary.json here.

    python bench/results/restore32/summarize.py
"""

import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    spec = importlib.util.spec_from_file_location(
        "summarize31", os.path.join(HERE, "..", "restore31", "summarize.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.HERE = HERE
    module.main()
