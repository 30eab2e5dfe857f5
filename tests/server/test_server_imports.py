"""The server talks to the engine only through its public API: no import reaches below it."""

from __future__ import annotations

import ast
from pathlib import Path

import firsttoken.engine
import firsttoken.server

SERVER_DIR = Path(firsttoken.server.__file__).parent
ALLOWED_MODULES = {
    "firsttoken",
    "firsttoken.engine",
    "firsttoken.engine_args",
    "firsttoken.metrics",
    "firsttoken.outputs",
    "firsttoken.sampling_params",
    "firsttoken.server",
}
ALLOWED_PACKAGES = ("firsttoken.metrics.", "firsttoken.server.")


def _firsttoken_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every firsttoken import in one source file, nested ones too."""
    imports = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "firsttoken":
            imports.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            imports.extend(
                (alias.name, []) for alias in node.names if alias.name.split(".")[0] == "firsttoken"
            )
    return imports


def test_server_modules_import_only_the_public_api():
    public_engine_names = set(firsttoken.engine.__all__)
    offending = []
    for path in sorted(SERVER_DIR.glob("*.py")):
        for module, names in _firsttoken_imports(path):
            if module not in ALLOWED_MODULES and not module.startswith(ALLOWED_PACKAGES):
                offending.append(f"{path.name}: {module}")
            elif module == "firsttoken.engine" and not set(names) <= public_engine_names:
                offending.append(f"{path.name}: {module} {sorted(set(names) - public_engine_names)}")
    assert not offending, offending
