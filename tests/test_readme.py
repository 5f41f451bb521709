"""The Python examples of README.md and docs/*.md run as written.

Every fenced block whose info string starts with ``python`` runs, in order, in one namespace
per document, in a fresh interpreter (so a document's own imports are what it gets). A block
tagged ``python gpu`` runs only where CUDA is present. Tracebacks name the document and line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The README first, then the docs in name order; each document starts a fresh namespace.
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
# An opening fence (backticks or tildes, possibly indented) and its info string.
_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)$")

_RUNNER = """
import json, sys
blocks = json.load(open(sys.argv[1]))
namespaces = {}
for block in blocks:
    namespace = namespaces.setdefault(block["file"], {"__name__": "__readme__"})
    print(f"{block['file']}:{block['line']}: running", flush=True)
    # Pad with newlines so tracebacks show the document's own line numbers.
    code = "\\n" * (block["line"] - 1) + block["code"]
    exec(compile(code, block["file"], "exec"), namespace)
print("all blocks ran", flush=True)
"""


def python_blocks(text: str) -> list[dict]:
    """[{line, tags, code}] of every ``python`` fenced block, in order; ``line`` is the first
    line of code (1-based) and ``tags`` the words after ``python`` in the info string."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = _OPEN.match(lines[i])
        i += 1
        if not opening:
            continue
        fence, indent = opening["fence"], opening["indent"]
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        start = i
        while i < len(lines) and not closing.match(lines[i]):
            i += 1
        words = opening["info"].split()
        if words and words[0].lower() == "python":
            body = [line.removeprefix(indent) for line in lines[start:i]]
            blocks.append({"line": start + 1, "tags": words[1:],
                           "code": textwrap.dedent("\n".join(body)) + "\n"})
        i += 1  # past the closing fence
    return blocks


def test_extractor_finds_python_blocks_only():
    text = textwrap.dedent("""\
        ```bash
        echo not python
        ```
        ```python
        a = 1
        ```
        - a list item:

          ```python gpu
          b = a + 1
          ```
        ~~~~python title="x"
        ```
        c = 3
        ~~~~
        ```
        ```python
        not python: inside the unclosed fence above
        """)
    blocks = python_blocks(text)
    assert [(b["line"], b["tags"], b["code"]) for b in blocks] == [
        (5, [], "a = 1\n"), (10, ["gpu"], "b = a + 1\n"),
        (13, ['title="x"'], "```\nc = 3\n")]


def _document_blocks() -> list[dict]:
    """Every document's python blocks, each marked with its path from the repository root."""
    return [block | {"file": str(path.relative_to(ROOT))}
            for path in DOCUMENTS for block in python_blocks(path.read_text())]


def test_readme_python_blocks_run(tmp_path):
    blocks = _document_blocks()
    runnable = [b for b in blocks if "gpu" not in b["tags"] or torch.cuda.is_available()]
    assert any("gpu" not in b["tags"] for b in blocks if b["file"] == "README.md"), \
        "the README has no CPU-runnable example"
    (tmp_path / "blocks.json").write_text(json.dumps(runnable))
    # Caches in tmp_path: the examples must not write into the user's cache directories.
    env = os.environ | {"CSA_OPS_CACHE_DIR": str(tmp_path / "kernels"),
                        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    done = subprocess.run([sys.executable, "-c", _RUNNER, str(tmp_path / "blocks.json")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    skipped = [f"{b['file']}:{b['line']}" for b in blocks if b not in runnable]
    ran = [f"{b['file']}:{b['line']}" for b in runnable]
    print(f"ran blocks at {ran}, skipped (gpu) {skipped}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.rstrip().endswith("all blocks ran")
