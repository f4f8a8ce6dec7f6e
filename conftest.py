"""Shared by the three suites (tests/, tests_onegpu/, tests_multigpu/): a failure's report is
written the moment the test fails, not only in the summary at the end, so a run cut off by a
time limit (a GPU call's step limit, CI's) still shows why each failed test failed."""


def pytest_runtest_logreport(report):
    if report.failed:
        print(f"\n==== {report.nodeid} failed ({report.when}) ====\n{report.longreprtext[-6000:]}\n", flush=True)
