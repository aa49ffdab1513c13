"""Layering rules, enforced (as napari does with import-linter)."""

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app"


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_only_app_ui_imports_qt():
    offenders = [str(p.relative_to(APP)) for p in APP.rglob("*.py")
                 if "ui" not in p.relative_to(APP).parts[:1] and imports(p) & {"PySide6", "qasync", "shiboken6"}]
    assert offenders == []


def test_one_http_client():
    users = sorted(str(p.relative_to(APP)) for p in APP.rglob("*.py") if "httpx" in imports(p))
    assert users == ["server/client.py"]


def test_no_shell_strings_for_subprocesses():
    for p in APP.rglob("*.py"):
        text = p.read_text()
        assert "shell=True" not in text, p
        assert "os.system(" not in text, p
