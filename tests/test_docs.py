"""The docs stay true: every Python block in README.md and docs/*.md runs as written, the
architecture page names every module of the package, and README and architecture keep their size.

Each README block runs alone, as a reader pastes just that one: in a fresh interpreter under plain
``python`` (no torchrun variables: the DeviceMesh example must make its own one-rank world) started
from an empty temporary folder, which must stay empty. The blocks of a page in docs/ continue one
another, so they run in order in one namespace, the same way.
"""

from __future__ import annotations

import os
import re
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


# torchrun's variables: a README block must not need them, so none reaches it from the test's own run.
_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _run_blocks(blocks: list[tuple[int, str]], name: str, folder: Path) -> None:
    """Run ``blocks`` in order in one fresh interpreter started in ``folder``; fail on any error."""
    script = _RUNNER.format(blocks=blocks, name=name)
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=folder, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"{len(blocks)} blocks ran" in result.stdout
    assert list(folder.iterdir()) == [], "a doc example left files behind"


def test_the_readme_has_examples() -> None:
    assert len(python_blocks(ROOT / "README.md")) >= 4


_README_BLOCKS = python_blocks(ROOT / "README.md")


@pytest.mark.parametrize("block", _README_BLOCKS, ids=[f"line{line}" for line, _ in _README_BLOCKS])
def test_every_readme_block_runs_alone(block: tuple[int, str], tmp_path: Path) -> None:
    _run_blocks([block], "README.md", tmp_path)


@pytest.mark.parametrize("doc", [p for p in DOCS[1:] if python_blocks(p)], ids=lambda p: p.name)
def test_every_python_block_of_a_page_runs(doc: Path, tmp_path: Path) -> None:
    _run_blocks(python_blocks(doc), doc.name, tmp_path)


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
