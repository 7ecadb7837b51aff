"""Each failing test's report written to a file as soon as it arrives (pytest plugin, on when `DELTAJAX_FAILURE_LOG`
names the file).

A device call has a hard time limit, and pytest prints its tracebacks only in the summary at the end: a run cut off
by the limit says which tests failed but not why (2026-12-05, six compiled tests on the H100). With the variable
set, the report of every failed or erroring test phase is appended to the file when pytest receives it, so the
reasons survive the cut. Under xdist the controller writes (it receives every worker's reports); the workers do not,
so each report is written once."""

import os

FAILURE_LOG = "DELTAJAX_FAILURE_LOG"


def pytest_runtest_logreport(report):
    path = os.environ.get(FAILURE_LOG)
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a", encoding="utf-8") as log:
        log.write(f"=== {report.nodeid} ({report.when}) FAILED\n{report.longreprtext}\n\n")
