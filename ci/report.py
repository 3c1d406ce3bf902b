"""Reads a real-server tier's JUnit report and fails unless every test ran and passed.

Usage: python ci/report.py TIER REPORT PYTEST_EXIT_CODE. Under CI a skipped real-server test is a
failure, as is a run that executes none (pytest's "no tests collected", exit 5).
"""

import sys
import xml.etree.ElementTree as ET

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
    f"{tier}: {passed} real-server tests passed, {count['failures'] + count['errors']} failed, "
    f"{count['skipped']} skipped in {float(suite.get('time', 0)):.0f} s"
)
if rc != 0 or passed == 0 or count["skipped"]:
    sys.exit(f"{tier}: the tier must run every test and pass them all")
