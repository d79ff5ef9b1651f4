"""The quick starts of docs/guide.md cannot rot: examples/python/quickstart.py runs here (the C++
one is the ctest example_cpp_quickstart), and every code block of the guide marked
`<!-- example: PATH -->` must be a verbatim excerpt of that example file."""

import os
import pathlib
import re
import subprocess
import sys

import attnkit

ROOT = pathlib.Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!-- example: (\S+) -->\s*\n```\w*\n(.*?)```", re.S)


def test_python_quickstart_runs():
    env = dict(os.environ)
    package_dir = str(pathlib.Path(attnkit.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_dir, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "python" / "quickstart.py")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "quick start ok" in proc.stdout
    assert "rejected: k.shape[1]: must divide q.shape[1] (8), got 3" in proc.stdout


def test_guide_code_is_the_examples_code():
    guide = (ROOT / "docs" / "guide.md").read_text()
    blocks = MARKER.findall(guide)
    assert {path for path, _ in blocks} >= {"examples/cpp/quickstart.cc",
                                            "examples/python/quickstart.py",
                                            "examples/cpp/CMakeLists.txt"}
    for path, block in blocks:
        source = (ROOT / path).read_text()
        assert block.strip() and block in source, (
            f"docs/guide.md: a block marked {path} is not a verbatim excerpt of it:\n{block}")
