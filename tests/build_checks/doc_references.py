"""ctest doc_references: every document the tree cites (a name ending in .md in the docs, the
code's comments, the scripts) is a file of the repository, so no reference points at a document
a reader does not have.

    python3 doc_references.py SOURCE_DIR

A reference resolves against the repository's root, the citing file's directory or docs/. The
only names that need not exist are the outputs that bench/peers.py writes (OUTPUTS).
"""

import os
import re
import sys

# Files bench/peers.py writes into the directory it is given (docs/bench.md, "Peers").
OUTPUTS = {"peers.md", "DIR/performance.md", "docs_dir/performance.md"}
SKIP_DIRS = {".git", "__pycache__", ".whl", ".gl", ".carry", "dist"}
TEXT_SUFFIXES = (".md", ".cc", ".h", ".cu", ".cuh", ".inc", ".py", ".cmake", ".txt", ".sh",
                 ".toml", ".in", ".pyi", ".json")
TEXT_NAMES = {"Makefile", "run"}
REFERENCE = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.md)\b")


def text_files(root):
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith("build")]
        for name in files:
            if name.endswith(TEXT_SUFFIXES) or name in TEXT_NAMES:
                yield os.path.join(top, name)


def main():
    root = os.path.realpath(sys.argv[1])
    missing, cited = [], 0
    for path in text_files(root):
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                for ref in REFERENCE.findall(line):
                    cited += 1
                    places = (root, os.path.dirname(path), os.path.join(root, "docs"))
                    if ref in OUTPUTS or any(os.path.isfile(os.path.join(p, ref)) for p in places):
                        continue
                    missing.append(f"{os.path.relpath(path, root)}:{number}: {ref}")
    if cited == 0:
        sys.exit(f"no document references found under {root}")
    if missing:
        sys.exit("references to documents that are not in the repository:\n" + "\n".join(missing))
    print(f"{cited} references to documents, all in the repository")


if __name__ == "__main__":
    main()
