"""torchrun entry for the tests of runs in several processes: `fast_clock_launch.py MODULE ARGS...`
runs MODULE.main(ARGS) with process 1's clock (MODULE.time.time) a thousand times fast, so any
decision a process takes by its own clock comes out differently on process 1."""
import importlib
import os
import sys
import time
import types

trainer = importlib.import_module(sys.argv[1])
if os.environ["RANK"] == "1":
    start, real = time.time(), time.time
    trainer.time = types.SimpleNamespace(time=lambda: start + (real() - start) * 1000)
sys.exit(trainer.main(sys.argv[2:]))
