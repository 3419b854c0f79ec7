"""The docs stay true: every Python block in README.md and docs/*.md runs as written, the
architecture page names every module of the package, and README and architecture keep their size.

The blocks of one file run in order in one namespace, as a reader pastes them, in a fresh
interpreter started from an empty temporary folder, with torchrun's variables for a one-rank world
(the README's DeviceMesh example runs under ``torchrun`` or alone).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "moe_gmm"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

_RUNNER = """
import sys
blocks = {blocks!r}
namespace = {{"__name__": "__main__"}}
for i, (line, source) in enumerate(blocks):
    try:
        exec(compile(source, f"{name}:{{line}}", "exec"), namespace)
    except BaseException:
        print(f"block {{i + 1}} of {name} (line {{line}}) failed", file=sys.stderr)
        raise
print(f"{{len(blocks)}} blocks ran")
"""


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """``(first line, source)`` of every fenced ``python`` block in ``path``."""
    text = path.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in _BLOCK.finditer(text)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_readme_has_examples() -> None:
    assert len(python_blocks(ROOT / "README.md")) >= 4


@pytest.mark.parametrize("doc", [p for p in DOCS if python_blocks(p)], ids=lambda p: p.name)
def test_every_python_block_runs(doc: Path, tmp_path: Path) -> None:
    script = _RUNNER.format(blocks=python_blocks(doc), name=doc.name)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        **{"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"},
        **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())},
    }
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"{len(python_blocks(doc))} blocks ran" in result.stdout
    assert list(tmp_path.iterdir()) == [], "a doc example left files behind"


def test_architecture_names_every_module() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    sources = [p for ext in ("*.py", "*.cpp", "*.h", "*.yaml") for p in PACKAGE.rglob(ext)]
    missing = [
        str(p.relative_to(PACKAGE))
        for p in sources
        if p.stem not in ("__init__", "__main__") and not re.search(rf"\b{re.escape(p.stem)}\b", text)
    ]
    assert missing == [], f"docs/architecture.md does not name: {missing}"


@pytest.mark.parametrize(("doc", "most"), [("README.md", 130), ("docs/architecture.md", 250)])
def test_docs_stay_short(doc: str, most: int) -> None:
    lines = (ROOT / doc).read_text(encoding="utf-8").count("\n")
    assert lines <= most, f"{doc} has {lines} lines; keep it under {most} and move detail to docs/"
