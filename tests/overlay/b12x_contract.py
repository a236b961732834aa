"""The real b12x API, read from the sources of the b12x release nix/runtime-lock.json pins.

.ci/setup installs that release (hash-checked, without dependencies) into
``.venv/pinned/b12x-VERSION``, off vLLM's import path. b12x's kernel modules need CUDA and
CUTLASS DSL to import, so signatures and vocabularies are read from the source files (ast):
a stub with the same parameter list is compiled, so ``inspect.Signature.bind`` applies b12x's
own rules (keyword-only parameters, required arguments, unknown names).

Used by the contract tests and by the b12x stand-in (``b12x_standin.py``) that the vLLM-path
checks run against.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PINNED_DIR_ENV = "DSPARK_B12X_SOURCE"


def pinned_version() -> str:
    lock = json.loads((REPO / "nix/runtime-lock.json").read_text())
    return next(p["version"] for p in lock["packages"] if p["name"] == "b12x")


def source_root() -> Path | None:
    """The folder holding the pinned ``b12x/`` package sources, or None if absent."""
    env = os.environ.get(PINNED_DIR_ENV)
    root = Path(env) if env else REPO / ".venv/pinned" / f"b12x-{pinned_version()}"
    return root if (root / "b12x/moe/fused_moe/api.py").is_file() else None


def _module_file(module: str) -> Path:
    root = source_root()
    assert root is not None, "pinned b12x sources are not installed (run .ci/setup)"
    path = root.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def module_exists(module: str) -> bool:
    root = source_root()
    return root is not None and _module_file(module).is_file()


@cache
def _tree(module: str) -> ast.Module:
    return ast.parse(_module_file(module).read_text())


class _Default:
    """Stands for a default value the stub cannot evaluate (a name from b12x)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _stub_signature(args: ast.arguments, drop_self: bool) -> inspect.Signature:
    defaults: dict[str, object] = {}

    def value(node):
        try:
            return ast.literal_eval(node)
        except ValueError:
            return _Default(ast.unparse(node))

    positional = [*args.posonlyargs, *args.args]
    for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults, strict=True):
        defaults[arg.arg] = value(default)
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        if default is not None:
            defaults[arg.arg] = value(default)
    params = []
    kind = inspect.Parameter.POSITIONAL_ONLY
    for i, arg in enumerate(positional):
        if i == len(args.posonlyargs):
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        params.append(inspect.Parameter(arg.arg, kind, default=defaults.get(arg.arg, inspect._empty)))
    if args.vararg:
        params.append(inspect.Parameter(args.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
    for arg in args.kwonlyargs:
        params.append(inspect.Parameter(arg.arg, inspect.Parameter.KEYWORD_ONLY,
                                        default=defaults.get(arg.arg, inspect._empty)))
    if args.kwarg:
        params.append(inspect.Parameter(args.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    if drop_self and params and params[0].name in ("self", "cls"):
        params = params[1:]
    return inspect.Signature(params)


@cache
def function_signature(module: str, name: str) -> inspect.Signature:
    """Signature of ``module.name`` (``Class.method`` for a method, without ``self``)."""
    cls_name, _, func = name.rpartition(".")
    body = _tree(module).body
    if cls_name:
        cls = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls_name)
        body = cls.body
    node = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == func)
    return _stub_signature(node.args, drop_self=bool(cls_name))


@cache
def dataclass_signature(module: str, cls_name: str) -> inspect.Signature:
    """Constructor of a dataclass: its annotated fields in order (``kw_only`` honoured)."""
    cls = next(n for n in _tree(module).body
               if isinstance(n, ast.ClassDef) and n.name == cls_name)
    kw_only = any(
        isinstance(d, ast.Call) and any(k.arg == "kw_only" and ast.literal_eval(k.value)
                                        for k in d.keywords)
        for d in cls.decorator_list
    )
    kind = inspect.Parameter.KEYWORD_ONLY if kw_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = []
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.value is None:
                default = inspect._empty
            else:
                try:
                    default = ast.literal_eval(node.value)
                except ValueError:
                    default = _Default(ast.unparse(node.value))
            params.append(inspect.Parameter(node.target.id, kind, default=default))
    return inspect.Signature(params)


@cache
def api_aliases() -> dict[str, tuple[str, str]]:
    """``b12x.moe.fused_moe.api`` public name -> (defining module, name there)."""
    out: dict[str, tuple[str, str]] = {}
    for node in _tree("b12x.moe.fused_moe.api").body:
        if isinstance(node, ast.ImportFrom):
            base = "b12x.moe.fused_moe"
            parts = base.split(".")
            if node.level > 1:
                parts = parts[: len(parts) - (node.level - 1)]
            module = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                out[alias.asname or alias.name] = (module, alias.name)
        elif isinstance(node, ast.FunctionDef):
            out[node.name] = ("b12x.moe.fused_moe.api", node.name)
    return out


def api_entry_points() -> tuple[str, ...]:
    """``__all__`` of ``b12x.moe.fused_moe.api``."""
    for node in _tree("b12x.moe.fused_moe.api").body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("b12x.moe.fused_moe.api has no __all__")


def api_signature(name: str) -> inspect.Signature:
    module, real = api_aliases()[name]
    return function_signature(module, real)


def _literal(module: str, name: str):
    for node in _tree(module).body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            value = node.value
            if isinstance(value, ast.Call) and ast.unparse(value.func) in ("frozenset", "set"):
                value = value.args[0]
                return frozenset(_evaluate_set(module, value))
            return ast.literal_eval(value)
    raise AssertionError(f"{module} defines no {name}")


def _evaluate_set(module: str, node: ast.expr) -> set:
    if isinstance(node, (ast.Set, ast.List, ast.Tuple)):
        return {_evaluate_item(module, e) for e in node.elts}
    return set(ast.literal_eval(node))


def _evaluate_item(module: str, node: ast.expr):
    if isinstance(node, ast.Name):
        return _literal(module, node.id)
    return ast.literal_eval(node)


IMPL = "b12x.moe.fused_moe._impl"


def vocabulary() -> dict[str, frozenset[str]]:
    """b12x's own accepted strings for the fused-MoE planning calls."""
    quant_modes = {"nvfp4", "w4a16"} | set(_literal(IMPL, "_W4A8_QUANT_MODES")) | set(
        _literal(IMPL, "_W6A8_QUANT_MODES"))
    # _normalize_quant_mode_requested accepts exactly these (read from its body).
    fn = next(n for n in _tree(IMPL).body
              if isinstance(n, ast.FunctionDef) and n.name == "_normalize_quant_mode_requested")
    assert '{"nvfp4", "w4a16"}' in ast.unparse(fn).replace("'", '"'), ast.unparse(fn)
    return {
        "quant_mode": frozenset(quant_modes),
        "source_format": frozenset(_literal(IMPL, "_FP4_SOURCE_FORMATS")),
        "w13_layout": frozenset(_literal(IMPL, "_W13_LAYOUTS")),
        "activation": _literal("b12x.moe._shared.kernels.activations",
                               "SUPPORTED_MOE_ACTIVATIONS"),
    }


def valid_source_and_mode(source_format: str, quant_mode: str) -> bool:
    """b12x's ``_validate_fp4_source_format_for_quant_mode``, restated for the FP4 sources
    the overlay uses; the contract test checks the rule's text is unchanged."""
    if quant_mode == "w4a16":
        return True
    if source_format == "modelopt_nvfp4":
        return True
    return source_format == "fp4_e8m0_k32" and quant_mode == "w4a8_mx"


def validation_rule_source() -> str:
    fn = next(n for n in _tree(IMPL).body if isinstance(n, ast.FunctionDef)
              and n.name == "_validate_fp4_source_format_for_quant_mode")
    return ast.unparse(fn)


W4A16_KERNEL = "b12x.moe._shared.kernels.w4a16.kernel"
W4A16_HOST = "b12x.moe._shared.kernels.w4a16.host"


def real_functions(module: str, names: tuple[str, ...]) -> dict[str, object]:
    """b12x's own pure-Python functions ``names`` of ``module``, compiled from the pinned
    sources with every module-level function and constant they reach (transitively).
    Refuses one that reaches an import (torch, cutlass, ...): only host arithmetic runs."""
    tree = _tree(module)
    defs: dict[str, ast.stmt] = {}
    imported: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    defs[t.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imported.update((a.asname or a.name).split(".")[0] for a in node.names)
    wanted: list[str] = []
    todo = list(names)
    while todo:  # bounded: each module-level name is taken once
        name = todo.pop()
        if name in wanted:
            continue
        if name in imported or name not in defs:
            raise AssertionError(f"{module}.{name} is not pure host code here")
        wanted.append(name)
        node = defs[name]
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                ref = sub.id
                if ref in defs and ref not in wanted:
                    todo.append(ref)
                elif ref in imported and ref not in ("annotations",):
                    raise AssertionError(f"{module}.{name} reaches the import {ref}")
    order = [n for n in tree.body if any(defs.get(w) is n for w in wanted)]
    code = compile(ast.Module(body=order, type_ignores=[]), str(_module_file(module)), "exec")
    ns: dict[str, object] = {"__name__": module}
    exec(code, ns)
    return {n: ns[n] for n in wanted}
