"""torchrun entry for the tests of runs in several processes: `fast_clock_launch.py MODULE ARGS...`
runs MODULE.main(ARGS) with process 1's clock (MODULE.time.time) a hundred thousand times fast,
so any decision a process takes by its own clock comes out differently on process 1. Each process
writes the learning-rate factors it used (MODULE.learning_rate_factor, where there is one) to
lr-RANK.json, and the loss and accuracies it reported at each step (MODULE.record_step) to
reports-RANK.json, in the folder $RECORD_STEPS names."""
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
factors, reports = [], []
if hasattr(trainer, "learning_rate_factor"):
    factor_of = trainer.learning_rate_factor
    trainer.learning_rate_factor = lambda *args: factors.append(factor_of(*args)) or factors[-1]
if hasattr(trainer, "record_step"):
    record = trainer.record_step
    trainer.record_step = lambda state, t, loss, accuracy, *rest: (reports.append([loss, *accuracy])
                                                                   or record(state, t, loss, accuracy, *rest))
code = trainer.main(sys.argv[2:])
if os.environ.get("RECORD_STEPS"):
    for name, values in [("lr", factors), ("reports", reports)]:
        with open(os.path.join(os.environ["RECORD_STEPS"], f"{name}-{os.environ['RANK']}.json"), "w") as f:
            json.dump(values, f)
sys.exit(code)
