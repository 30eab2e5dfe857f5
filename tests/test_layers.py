"""The package's imports point down its layers, and the server talks to the engine only.

Layers, top to bottom (LAYERS below): the command line; the Ray Serve deployment (an ingress
serving the server's app in front of engine replicas); the server and the benchmarks; the public
API (`firsttoken/__init__.py`); the engine; the worker; the sampler; models, core, metrics and the
speculative proposers; attention; ops; then the plain modules everything may use (arithmetic, cache
locks, config, errors, logprobs, outputs, progress bars, request, sampling parameters, the stage
observer, the tokenizer). A module may
import its own part of the package and any part on a lower layer; every import counts, those
inside functions and under TYPE_CHECKING too. So each layer can be read and tested without the
ones above it: the scheduler with fake requests, a model without an engine, the server on a fake
engine.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import firsttoken.engine

PACKAGE_DIR = pathlib.Path(firsttoken.engine.__file__).parent.parent

LAYERS: list[set[str]] = [
    {"__main__"},
    {"cli"},
    {"deploy"},
    {"server", "bench", "calibration"},
    {"firsttoken"},
    {"engine"},
    {"worker"},
    {"sample"},
    {"models", "core", "metrics", "speculative"},
    {"attention"},
    {"ops"},
    {
        "arithmetic", "cache_lock", "config", "engine_args", "errors", "logprobs", "outputs", "progress",
        "limits", "request", "sampling_params", "stage_observer", "tokenizer",
    },
]
RANK = {part: len(LAYERS) - index for index, parts in enumerate(LAYERS) for part in parts}
BASE_RANK = 1

# What the server may import besides itself: the engine's public API (its __all__), the
# package's version, observability, plain data and arithmetic; a package here includes its modules.
SERVER_MAY_IMPORT_MODULES = {
    "firsttoken",
    "firsttoken.arithmetic",
    "firsttoken.engine",
    "firsttoken.limits",
    "firsttoken.outputs",
    "firsttoken.sampling_params",
}
SERVER_MAY_IMPORT_PACKAGES = {"firsttoken.metrics", "firsttoken.engine_args"}
NO_TORCH_PACKAGES = ("core", "engine")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _part(module: str) -> str:
    """The layer unit of a firsttoken module: its first component below the package."""
    components = module.split(".")
    return components[1] if len(components) > 1 else "firsttoken"


def _imports(path: pathlib.Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, imported names) of every import statement in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
    return found


def _sources() -> list[pathlib.Path]:
    return sorted(PACKAGE_DIR.rglob("*.py"))


def _package_imports():
    for path in _sources():
        module = _module_name(path)
        for line, imported, names in _imports(path):
            if imported == "firsttoken" or imported.startswith("firsttoken."):
                yield path, line, module, imported, names


def test_every_part_of_the_package_has_a_layer():
    parts = {_part(_module_name(path)) for path in _sources()}
    assert parts <= set(RANK), f"no layer for {sorted(parts - set(RANK))}: add them to LAYERS"


def test_imports_point_down_the_layers():
    upward = []
    for path, line, module, imported, _ in _package_imports():
        source, target = _part(module), _part(imported)
        if source == target or RANK[source] == RANK[target] == BASE_RANK:
            continue
        if RANK[target] >= RANK[source]:
            upward.append(f"{path.relative_to(PACKAGE_DIR.parent)}:{line}: {source} imports {imported}")
    assert not upward, "imports that do not point down:\n" + "\n".join(upward)


def test_the_server_talks_to_the_engines_public_api_only():
    public = set(firsttoken.engine.__all__)
    strays = []
    for path, line, module, imported, names in _package_imports():
        if _part(module) != "server" or imported.startswith("firsttoken.server"):
            continue
        allowed = imported in SERVER_MAY_IMPORT_MODULES or any(
            imported == package or imported.startswith(package + ".")
            for package in SERVER_MAY_IMPORT_PACKAGES
        )
        private = imported == "firsttoken.engine" and not set(names) <= public
        if not allowed or private:
            strays.append(f"{path.relative_to(PACKAGE_DIR.parent)}:{line}: {imported} {names}")
    assert not strays, "the server reaches past the engine's public API:\n" + "\n".join(strays)


@pytest.mark.parametrize("package", NO_TORCH_PACKAGES)
def test_bookkeeping_holds_no_tensor(package):
    tensor_imports = [
        f"{path.relative_to(PACKAGE_DIR.parent)}:{line}: {imported}"
        for path in sorted((PACKAGE_DIR / package).rglob("*.py"))
        for line, imported, _ in _imports(path)
        if imported.split(".")[0] in {"torch", "numpy", "triton"}
    ]
    assert not tensor_imports, f"{package}/ imports a tensor library:\n" + "\n".join(tensor_imports)


def test_ray_is_imported_by_the_deployment_alone():
    """Ray is an optional extra: the engine and the server import without it, and so does the
    routing decision (its tests run without Ray)."""
    ray_free = {"firsttoken.deploy", "firsttoken.deploy.routing", "firsttoken.deploy.messages"}
    strays = [
        f"{path.relative_to(PACKAGE_DIR.parent)}:{line}: {imported}"
        for path in _sources()
        if _part(_module_name(path)) != "deploy" or _module_name(path) in ray_free
        for line, imported, _ in _imports(path)
        if imported.split(".")[0] == "ray"
    ]
    assert not strays, "imports of ray outside firsttoken/deploy's Ray-facing modules:\n" + "\n".join(strays)


def _module_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports; `from package import name` counts as importing
    the submodule when `name` is one."""
    modules = {_module_name(path) for path in _sources()}
    graph: dict[str, set[str]] = {module: set() for module in modules}
    for path in _sources():
        module = _module_name(path)
        for _, imported, names in _imports(path):
            submodules = [f"{imported}.{name}" for name in names if f"{imported}.{name}" in modules]
            for target in submodules or [imported]:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != module:
                    graph[module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    order: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = lowest[module] = len(order)
        stack.append(module)
        for target in graph[module]:
            if target not in order:
                visit(target)
                lowest[module] = min(lowest[module], lowest[target])
            elif target in stack:
                lowest[module] = min(lowest[module], order[target])
        if lowest[module] == order[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                components.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return components


def test_no_modules_import_each_other_even_lazily():
    cycles = _cycles(_module_graph())
    assert not cycles, "modules in an import circle:\n" + "\n".join(" <-> ".join(cycle) for cycle in cycles)
