"""A GPU suite's ``pytest -v`` log (``bench/run.sh``'s ``$OUT/tests.log``) in a few lines, for a
device call whose files must stay few: per test file the tests that passed, failed or were
skipped (a file a run's time limit cut shows fewer than it has), then each failure's ``E`` lines.

    python3 bench/tools/test_summary.py $OUT/tests.log > $OUT/tests-summary.txt
"""

from __future__ import annotations

import re
import sys
from collections import Counter, defaultdict

WORDS = "PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS"
# "tests/x.py::t PASSED" (one process) or "[gw3] [ 10%] PASSED tests/x.py::t" (pytest-xdist)
OUTCOME = re.compile(rf"(?:(tests/[\w/]+\.py)::(\S+) ({WORDS}))|(?:({WORDS}) (tests/[\w/]+\.py)::(\S+))")


def main(path: str) -> None:
    text = open(path, errors="replace").read()
    counts: dict[str, Counter] = defaultdict(Counter)
    failed = []
    for m in OUTCOME.finditer(text):
        file, test, outcome = m.group(1, 2, 3) if m.group(1) else m.group(5, 6, 4)
        counts[file][outcome] += 1
        if outcome in ("FAILED", "ERROR") and f"{file}::{test}" not in failed:
            failed.append(f"{file}::{test}")
    for file in sorted(counts):
        print(f"{file}: " + ", ".join(f"{n} {what.lower()}" for what, n in sorted(counts[file].items())))
    tail = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    print(tail[-1] if tail else "no summary line: the run was cut")
    for name in failed:
        print(f"\nFAILED {name}")
        section = text.split(name.split("::")[1], 2)
        lines = [line for line in "".join(section[1:]).splitlines() if line.startswith("E ")]
        print("\n".join(lines[:12]))


if __name__ == "__main__":
    main(sys.argv[1])
