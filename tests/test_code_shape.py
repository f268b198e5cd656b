"""The shape the code keeps: no function of ``src/`` over 100 lines (its complexity, at most
24, is ruff's ``C901`` in ``pyproject.toml``)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "dapple"
MAX_LINES = 100


def long_functions(root: Path, limit: int = MAX_LINES) -> list[str]:
    """``path:line name (n lines)`` of each function under ``root`` longer than ``limit``
    lines (decorators left out, docstring included)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_of_src_is_over_100_lines() -> None:
    assert long_functions(SRC) == []


def test_a_long_function_is_found(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(100))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path) == ["m.py:5 long (101 lines)"]
