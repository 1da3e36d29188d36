"""pytest plugin for device runs: appends each failure's report to $FAILURES_NOW the moment it
happens. pytest prints the reports only when the suite ends, so a suite cut off by its time limit
(the usual case on a lent GPU) used to name its failures without saying why they failed.
Load it with PYTHONPATH=scripts/gpu and `-p failures_now`."""
import os


def pytest_runtest_logreport(report):
    # Under xdist the controller sees every worker's reports: write there only, once each.
    if not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(os.environ.get("FAILURES_NOW", "failures.txt"), "a") as out:
        out.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n\n")
