"""Every megahet import in code CI never runs resolves: the GPU tests (skipped without CUDA, their imports
sit inside the test functions), the benchmarks and the tools, which run by hand. A moved or renamed
module then fails here, on CPU, instead of on the next GPU machine.

Run: ``python -m pytest tests/unit/test_imports.py -q`` (seconds).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FILES = sorted([REPO / "tests" / "test_gpu.py", *REPO.glob("benchmarks/*.py"), *REPO.glob("tools/*.py")])


def _megahet_imports(path: Path) -> list[tuple[str, list[str]]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "megahet":
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] == "megahet"]
    return found


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_megahet_imports_resolve(path: Path) -> None:
    for module, names in _megahet_imports(path):
        imported = importlib.import_module(module)
        for name in names:
            assert hasattr(imported, name) or importlib.util.find_spec(f"{module}.{name}"), f"{module}.{name}"


def test_the_gpu_tests_import_megahet() -> None:
    """The check above has something to check in the file it exists for."""
    assert any(
        module.startswith("megahet.") for module, _ in _megahet_imports(REPO / "tests" / "test_gpu.py")
    )
