"""python -m attnrt info|run|check|bench|replay ...: the attnrt command-line tool.

The same program as the `attnrt` binary of the C++ build (installed inside this package), so the
options and the output are exactly the CLI's: `python -m attnrt --help`.
"""
import os
import sys


def cli_path() -> str:
    """Path of the attnrt executable that ships with this package."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "bin", "attnrt")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"the attnrt executable is missing from {os.path.dirname(path)}; reinstall the package "
            "(pip install .) from the repository")
    return path


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cli_path(), ["attnrt", *args])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
