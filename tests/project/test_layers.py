"""The package's layers point down: nothing imports the root command line (`dspark.cli.main`) but
the entry point, and the dspark modules' import graph has no cycle.

The graph is read from the source with `ast`: every import, at module level or inside a
function (the lazy imports that keep `dspark --help` fast are still dependencies), including
those under `if TYPE_CHECKING:`."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "dspark"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The dspark module an absolute dotted name lands in (the longest known prefix)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for mod, path in known.items():
        is_package = path.name == "__init__.py"
        package = mod if is_package else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    base_name = ".".join(base + ([node.module] if node.module else []))
                else:
                    base_name = node.module or ""
                # `from pkg import sub` imports the submodule pkg.sub when there is one
                targets = [f"{base_name}.{a.name}" if f"{base_name}.{a.name}" in known else base_name
                           for a in node.names]
            for t in targets:
                if t == "dspark" or t.startswith("dspark."):
                    hit = _resolve(t, known)
                    if hit is not None and hit != mod:
                        graph[mod].add(hit)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    """The reader sees the edges it must: a module-level one, a function-level one, a relative
    `from . import submodule` and a `from .. import name` resolved to the package."""
    graph = import_graph()
    assert "dspark.cli.main" in graph["dspark.__main__"]  # inside main()
    assert "dspark.node.states" in graph["dspark.node.agent_client"]  # module level
    assert "dspark.engine.facts" in graph["dspark.bench.client"]  # from .. import vllm_facts as F
    assert "dspark.plan.fit" in graph["dspark.plan.from_cluster"]  # inside a function


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_nothing_imports_the_root_command_line():
    graph = import_graph()
    importers = sorted(m for m, deps in graph.items() if "dspark.cli.main" in deps and m != "dspark.__main__")
    assert importers == [], f"these modules import dspark.cli.main (move the helper they need down): {importers}"


# The packages from the bottom up; a package imports only those in layers below its own (and the
# root package, for __version__). CONTRIBUTING.md says what each holds.
LAYERS = [
    {"log"},
    {"files"},
    {"engine", "lines", "net"},
    {"config"},
    {"plan", "units"},
    {"node"},
    {"bench", "dashboard", "monitoring", "preflight", "status"},
    {"switch", "local"},
    {"cli"},
    {"__main__"},
]


def package_of(module: str) -> str:
    """`dspark.node.supervisor` -> `node`; a top-level module is a package of its own."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "dspark"


def test_every_package_has_a_layer():
    packages = {package_of(m) for m in modules()} - {"dspark", "data"}  # data: vLLM loads its middleware
    placed = set().union(*LAYERS)
    assert packages == placed, f"not placed: {sorted(packages - placed)}; gone: {sorted(placed - packages)}"


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    layer = {p: i for i, ps in enumerate(LAYERS) for p in ps}
    return sorted((m, d) for m, deps in graph.items() for d in deps
                  if package_of(m) != package_of(d) and package_of(d) != "dspark"
                  and layer[package_of(d)] >= layer[package_of(m)])


def test_packages_import_only_the_layers_below():
    upward = upward_imports(import_graph())
    assert upward == [], "imports of a package in the same layer or above:\n" + "\n".join(
        f"{m} -> {d}" for m, d in upward)


def test_the_layer_check_refuses_an_upward_or_sideways_import():
    assert upward_imports({"dspark.node.supervisor": {"dspark.switch", "dspark.config.schema", "dspark"},
                           "dspark.bench.client": {"dspark.status"}}) == [
        ("dspark.bench.client", "dspark.status"), ("dspark.node.supervisor", "dspark.switch")]


def test_no_import_cycle():
    found = cycles(import_graph())
    assert found == [], "import cycles among dspark modules:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_one_fail_helper():
    """The commands end with an error through one helper (dspark.cli.common.fail): exit 2 for
    usage and config errors unless a runtime code is passed. (preflight.result.fail builds a
    failed check, it ends nothing: a helper here is a `fail` that raises.)"""
    defined = sorted(f"{m}.{n.name}" for m, path in modules().items()
                     for n in ast.walk(ast.parse(path.read_text()))
                     if isinstance(n, ast.FunctionDef) and n.name.lstrip("_") == "fail"
                     and any(isinstance(x, ast.Raise) for x in ast.walk(n)))
    assert defined == ["dspark.cli.common.fail"]


COMMAND_MODULES = {"dspark.cli.units", "dspark.cli.bench", "dspark.cli.dashboard", "dspark.cli.check",
                   "dspark.cli.switch", "dspark.cli.local"}


def test_no_module_imports_a_command_module():
    """A command module is reached through the root group's registry only; what two commands
    share lives below them (cli_common, cli_options or the owner)."""
    graph = import_graph()
    found = sorted((m, d) for m, deps in graph.items() for d in deps & COMMAND_MODULES)
    assert found == []


def test_the_registry_names_the_command_modules_and_they_import():
    """Every registered command's module imports and holds the command under its name (an
    ImportError there now surfaces when the command runs, so it is caught here first)."""
    import importlib

    from dspark.cli.main import LazyGroup, LocalGroup

    registered = {module for group in (LazyGroup, LocalGroup) for module, _, _ in group.lazy.values()}
    assert registered == COMMAND_MODULES
    for group in (LazyGroup, LocalGroup):
        for name, (module, attr, _) in group.lazy.items():
            assert getattr(importlib.import_module(module), attr).name == name
