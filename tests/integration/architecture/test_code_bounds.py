"""The size bounds of docs/architecture.md ("Bounds"): no class over 300 lines, no function
over 80 and no module over 700 in batcher/ and workers/, but for the declarative tables the
page names (each listed here with the page's reason)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MAX_CLASS, MAX_FUNCTION, MAX_MODULE = 300, 80, 700
PAGE = (ROOT / "docs" / "architecture.md").read_text()
#: "path:qualified name" of each unit the page excuses, as its bounds section lists them.
EXCUSED = set(re.findall(r"^- `([\w/.]+\.py(?::[\w.]+)?)`", PAGE.split("## Bounds", 1)[-1], re.M))
GENERATED = ("_pb2.py", "_pb2_grpc.py")


def sources() -> list[Path]:
    files = [*(ROOT / "batcher").rglob("*.py"), *(ROOT / "workers").rglob("*.py")]
    return sorted(f for f in files if not f.name.endswith(GENERATED))


def units(path: Path) -> list[tuple[str, str, int]]:
    """(kind, qualified name, lines) of every class and function in `path`."""
    found: list[tuple[str, str, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                found.append((kind, name, (child.end_lineno or child.lineno) - child.lineno + 1))
                walk(child, name + ".")

    walk(ast.parse(path.read_text()), "")
    return found


def test_every_excused_unit_exists() -> None:
    """An excuse for a unit that is gone, or was renamed, must go too."""
    known = set()
    for path in sources():
        rel = path.relative_to(ROOT).as_posix()
        known.add(rel)
        known.update(f"{rel}:{name}" for _, name, _ in units(path))
    assert known >= EXCUSED, sorted(EXCUSED - known)


@pytest.mark.parametrize("path", sources(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_unit_is_over_its_bound(path: Path) -> None:
    rel = path.relative_to(ROOT).as_posix()
    over = []
    lines = path.read_text().count("\n")
    if lines > MAX_MODULE and rel not in EXCUSED:
        over.append(f"module {rel}: {lines} lines > {MAX_MODULE}")
    for kind, name, length in units(path):
        bound = MAX_CLASS if kind == "class" else MAX_FUNCTION
        if length > bound and f"{rel}:{name}" not in EXCUSED:
            over.append(f"{kind} {rel}:{name}: {length} lines > {bound}")
    assert not over, over
