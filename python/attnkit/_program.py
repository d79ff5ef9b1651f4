"""The `attnkit` command of the pip package: runs the C++ program (info, check, config, bench,
replay; docs/guide.md) that the wheel installs inside the package, attnkit/bin/attnkit, where its
RUNPATH finds the package's libattnkit."""

import os
import sys


def program_path() -> str:
    """Where the wheel puts the attnkit program."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "attnkit")


def main() -> None:
    path = program_path()
    if not os.access(path, os.X_OK):
        # A package imported from a CMake build tree (PYTHONPATH=<build>/python) has no program
        # inside it: that build's program is <build>/attnkit.
        sys.exit(
            f"attnkit: the program is not part of this installation ({path} is missing); "
            "pip install . installs it, a CMake build has it at <build>/attnkit"
        )
    os.execv(path, [path, *sys.argv[1:]])
