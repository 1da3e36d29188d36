"""torchrun entry for the tests of runs in several processes: `fast_clock_launch.py MODULE ARGS...`
runs MODULE.main(ARGS) with process 1's clock (MODULE.time.time) a hundred thousand times fast,
so any decision a process takes by its own clock comes out differently on process 1. Each process
writes the learning-rate factors it used (MODULE.learning_rate_factor, where there is one) to
lr-RANK.json in the folder $RECORD_LEARNING_RATES names."""
import importlib
import json
import os
import sys
import time
import types

trainer = importlib.import_module(sys.argv[1])
if os.environ["RANK"] == "1":
    start, real = time.time(), time.time
    trainer.time = types.SimpleNamespace(time=lambda: start + (real() - start) * 100_000)
factors = []
if hasattr(trainer, "learning_rate_factor"):
    factor_of = trainer.learning_rate_factor
    trainer.learning_rate_factor = lambda *args: factors.append(factor_of(*args)) or factors[-1]
code = trainer.main(sys.argv[2:])
if os.environ.get("RECORD_LEARNING_RATES"):
    with open(os.path.join(os.environ["RECORD_LEARNING_RATES"], f"lr-{os.environ['RANK']}.json"), "w") as f:
        json.dump(factors, f)
sys.exit(code)
