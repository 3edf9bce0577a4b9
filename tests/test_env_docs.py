#!/usr/bin/env python3
"""Every ATTNRT_ environment variable the code reads is documented.

Scans the library, backends, tools, bench harness and Python package sources (not the tests) for
quoted ATTNRT_ names, and checks that each appears as `NAME` in docs/*.md (docs/backends.md keeps
the table of switches). ATTNRT_TEST_* variables belong to the tests and are skipped. Exits 1 and
lists what is missing.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ["src", "backends", "tools", "include", "bench", "python/attnrt"]
SUFFIXES = {".cpp", ".cc", ".h", ".hpp", ".cu", ".cuh", ".py"}
NAME = re.compile(r"[\"'](ATTNRT_[A-Z0-9_]+)[\"']")
DOC = re.compile(r"`(ATTNRT_[A-Z0-9_]+)`")


def names_in(paths, pattern):
    found = {}
    for path in paths:
        for m in pattern.finditer(path.read_text(errors="replace")):
            found.setdefault(m.group(1), path.relative_to(ROOT))
    return found


def main():
    code = names_in(
        (p for d in SOURCES if (ROOT / d).is_dir() for p in (ROOT / d).rglob("*")
         if p.suffix in SUFFIXES and p.is_file()),
        NAME)
    docs = names_in((ROOT / "docs").glob("*.md"), DOC)
    missing = sorted(n for n in code if n not in docs and not n.startswith("ATTNRT_TEST_"))
    if not code:
        print("no ATTNRT_ variables found in the sources: the scan is broken")
        return 1
    if missing:
        for n in missing:
            print(f"{n} (read in {code[n]}) is not documented in docs/*.md; add it to the table "
                  "of switches in docs/backends.md")
        return 1
    print(f"{len(code)} ATTNRT_ variables read by the code, all documented")
    return 0


if __name__ == "__main__":
    sys.exit(main())
