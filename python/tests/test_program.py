"""The `attnkit` console script (attnkit._program): it runs the program installed inside the
package, and says where it looked when there is none. scripts/pip_check.sh runs the installed
command end to end."""

import os
import stat
import subprocess
import sys

import pytest

from attnkit import _program


def test_program_path_is_inside_the_package():
    package_dir = os.path.dirname(os.path.abspath(_program.__file__))
    assert _program.program_path() == os.path.join(package_dir, "bin", "attnkit")


def test_missing_program_is_an_error_naming_the_path(monkeypatch, tmp_path):
    missing = str(tmp_path / "bin" / "attnkit")
    monkeypatch.setattr(_program, "program_path", lambda: missing)
    with pytest.raises(SystemExit) as exit_info:
        _program.main()
    assert missing in str(exit_info.value.code)
    assert "ATTNKIT_BUILD_TOOLS=OFF" in str(exit_info.value.code)


def test_runs_the_program_with_the_arguments(tmp_path):
    # A stand-in program that prints its arguments and exits with a status of its own: the console
    # script must pass both through unchanged (it replaces itself with the program).
    fake = tmp_path / "bin" / "attnkit"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "args:$*"\nexit 7\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    script = (
        "import sys; from attnkit import _program; "
        f"_program.program_path = lambda: {str(fake)!r}; sys.argv[1:] = ['info', '--json']; "
        "_program.main()"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 7, done.stderr
    assert done.stdout == "args:info --json\n"
