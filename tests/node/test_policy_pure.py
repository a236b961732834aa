"""The node policy stays pure: its modules (dspark.node.policy, .events, .line_follow and the
stage helpers they use) import nothing that does I/O, read from the source with `ast` (at module
level or in a function; a type named under `if TYPE_CHECKING:` alone is not an import at run time)."""

from __future__ import annotations

import ast
from pathlib import Path

import dspark

PACKAGE = Path(dspark.__file__).resolve().parent
PURE = ("node/policy.py", "node/events.py", "node/line_follow.py", "node/stages.py")
# Standard modules that reach processes, sockets, HTTP, files or the OS.
IO_STDLIB = {"subprocess", "socket", "http", "urllib", "os", "shutil", "threading", "ctypes", "select",
             "selectors", "pathlib", "io", "time", "asyncio", "multiprocessing"}
# dspark modules that do I/O (processes, probes, agents, sd_notify, files, the network, the host).
IO_DSPARK = ("dspark.node.vllm_process", "dspark.node.probes", "dspark.node.supervisor", "dspark.node.agent",
             "dspark.node.notify", "dspark.node.signals", "dspark.node.port_owner", "dspark.node.hardware",
             "dspark.node.host_memory", "dspark.node.rdma", "dspark.node.launch", "dspark.net", "dspark.files",
             "dspark.lines.state", "dspark.lines.history", "dspark.config")


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(path: Path) -> set[str]:
    """Every module `path` imports at run time."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def test_the_policy_modules_import_no_io_module() -> None:
    for rel in PURE:
        mods = imports(PACKAGE / rel)
        io = sorted(m for m in mods if m.split(".")[0] in IO_STDLIB
                    or any(m == d or m.startswith(d + ".") for d in IO_DSPARK))
        assert not io, f"{rel} imports {io}: the policy must stay pure (no I/O, no clock of its own)"


def test_the_check_sees_an_io_import(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import socket\n"
                      "def f() -> None:\n    from dspark.node.probes import VllmProbes\n")
    assert imports(sample) == {"typing", "typing.TYPE_CHECKING", "dspark.node.probes",
                               "dspark.node.probes.VllmProbes"}
