#!/usr/bin/env python3
"""Packs a replay case directory (attnrt run --dump-step N DIR) into one input of fuzz_case:
case.json's text, then for each other file a line "--- NAME" and the file's bytes."""
import pathlib
import sys


def pack(case_dir: pathlib.Path) -> bytes:
    out = (case_dir / "case.json").read_bytes().rstrip(b"\n")
    for f in sorted(case_dir.iterdir()):
        if f.name != "case.json":
            out += b"\n--- " + f.name.encode() + b"\n" + f.read_bytes()
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: pack_case.py CASE_DIR OUT_FILE")
    pathlib.Path(sys.argv[2]).write_bytes(pack(pathlib.Path(sys.argv[1])))
