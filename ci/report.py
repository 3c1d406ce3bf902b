"""Reads a tier's JUnit report (the real servers' tiers, the Ray metrics') and fails unless every
test ran and passed; prints the slowest tests (where the tier's time goes) and what each failure
raised.

Usage: python ci/report.py TIER REPORT PYTEST_EXIT_CODE. Under CI a skipped test of a tier is a
failure, as is a run that executes none (pytest's "no tests collected", exit 5).
"""

import sys
import xml.etree.ElementTree as ET

#: How many of the slowest tests to name.
SLOWEST = 12
#: How much of each failure's message to print.
MESSAGE = 600

tier, path, rc = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    suites = ET.parse(path).getroot()
except (OSError, ET.ParseError) as exc:
    sys.exit(f"{tier}: no test report ({exc}); pytest exited {rc}")
suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
assert suite is not None
count = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
print(
    f"{tier}: {passed} tests passed, {count['failures'] + count['errors']} failed, "
    f"{count['skipped']} skipped in {float(suite.get('time', 0)):.0f} s"
)
cases = sorted(suite.iter("testcase"), key=lambda c: -float(c.get("time", 0)))
for case in cases[:SLOWEST]:
    name = f"{case.get('classname')}::{case.get('name')}"
    print(f"{tier}:   {float(case.get('time', 0)):6.0f} s  {name}")
# What each failure raised, last: the end of a long log is what a reader sees first.
for case in suite.iter("testcase"):
    for failed in (*case.findall("failure"), *case.findall("error")):
        message = " ".join((failed.get("message") or failed.text or "").split())
        print(f"{tier}: FAILED {case.get('classname')}::{case.get('name')}: {message[:MESSAGE]}")
if rc != 0 or passed == 0 or count["skipped"]:
    sys.exit(f"{tier}: the tier must run every test and pass them all")
