#!/usr/bin/env python3
"""Count the tests a pytest run skipped, by reason.

    .ci/skips.py REPORT...

Each REPORT is either a JUnit XML file written by pytest's --junitxml, or a text file holding
pytest's output with -rs (its "short test summary info": `SKIPPED [N] path:line: reason`); "-"
reads standard input. The counts of all REPORTs are added up (one file per pytest run of
.ci/run, say). Prints

    skipped: N
      COUNT  REASON

one line per distinct reason, the most frequent first. Expected failures (xfail) are not
skips and are not counted. Exit status: 0, whatever the count; 2 on a report that cannot be read
(one line on stderr).
"""

from __future__ import annotations

import ast
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter

# pytest's -rs line: "SKIPPED [3] tests/nix/test_x.py:40: reason" (the ":40" is absent when
# pytest has no line number).
SUMMARY_LINE = re.compile(r"^SKIPPED \[(\d+)\] (\S+?)(?::\d+)?: (.*)$")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


class ReportError(Exception):
    pass


def from_junit(text: str, name: str) -> Counter:
    """<skipped type="pytest.skip" message="REASON"> of every <testcase> (collection skips too)."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        raise ReportError(f"{name}: not a JUnit XML file: {e}") from e
    out: Counter = Counter()
    for case in root.iter("testcase"):
        for skipped in case.findall("skipped"):
            if skipped.get("type") == "pytest.xfail":
                continue
            reason = skipped.get("message") or ""
            if reason == "collection skipped":
                # A module skipped whole: the text is the repr of (path, line, "Skipped: reason").
                reason = collection_reason(skipped.text or "") or reason
            out[reason.strip() or "no reason given"] += 1
    return out


def collection_reason(text: str) -> str | None:
    try:
        longrepr = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return None
    if isinstance(longrepr, tuple) and len(longrepr) == 3 and isinstance(longrepr[2], str):
        return longrepr[2].removeprefix("Skipped: ")
    return None


def from_summary(text: str) -> Counter:
    """The SKIPPED lines of pytest's -rs summary; pytest groups them by place and reason, so the
    same reason at two places comes as two lines and is added up here."""
    out: Counter = Counter()
    for line in text.splitlines():
        m = SUMMARY_LINE.match(ANSI.sub("", line).strip())
        if m:
            out[m.group(3).strip()] += int(m.group(1))
    return out


def read(name: str) -> Counter:
    try:
        text = sys.stdin.read() if name == "-" else open(name, encoding="utf-8", errors="replace").read()
    except OSError as e:
        raise ReportError(f"cannot read {name}: {e.strerror}") from e
    if text.lstrip().startswith("<"):
        return from_junit(text, name)
    return from_summary(text)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    total: Counter = Counter()
    try:
        for name in argv:
            total += read(name)
    except ReportError as e:
        print(f"skips: {e}", file=sys.stderr)
        return 2
    print(f"skipped: {sum(total.values())}")
    for reason, count in sorted(total.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {count:4d}  {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
