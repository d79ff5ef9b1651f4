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
        # A wheel built with ATTNKIT_BUILD_TOOLS=OFF, or the package of a CMake build tree
        # (PYTHONPATH=<build>/python, whose program is <build>/attnkit), has no program inside.
        sys.exit(
            f"attnkit: this installation has no attnkit program ({path} is missing): it was "
            "built with ATTNKIT_BUILD_TOOLS=OFF, or is a CMake build tree (the program is "
            "<build>/attnkit there)"
        )
    os.execv(path, [path, *sys.argv[1:]])
