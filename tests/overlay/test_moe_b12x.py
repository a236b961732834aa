"""The b12x MXFP4 MoE backend through vLLM's own code paths, and its contract with b12x.

vLLM paths: tests/overlay/moe_checks.py in a subprocess on the patched copy (and on the stock
copy, where every check must fail), with the SM12x platform simulated and a b12x stand-in
that binds every call to the pinned b12x's real signatures (b12x_standin.py).
Contract: the overlay's calls and strings against the pinned b12x sources (b12x_contract.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from . import b12x_contract as contract
from .conftest import OVERLAY_DIR, run_checks

HERE = Path(__file__).resolve().parent
NAMES = (
    "selects_b12x",
    "weight_path",
    "apply_through_modular_kernel",
    "force_a16",
    "nvfp4_a16_refused",
    "small_m_override",
    "eager_modules",
    "provider_warmup",
    "env_registered",
    "fp4_negative_zero",
    "topk_sentinels",
    "min_tokens_pad",
)

pytestmark = pytest.mark.skipif(
    contract.source_root() is None,
    reason="the pinned b12x sources are not installed (.ci/setup installs them)",
)


def run_moe_checks(site: Path, tmp: Path) -> dict[str, str]:
    from . import b12x_standin

    standin = b12x_standin.write_package(tmp / "standin")
    return run_checks(site, HERE / "moe_checks.py", path=(standin,))


@pytest.fixture(scope="module")
def moe_results(patched_site, tmp_path_factory) -> dict[str, str]:
    return run_moe_checks(patched_site, tmp_path_factory.mktemp("moe"))


@pytest.mark.parametrize("name", NAMES)
def test_moe_path(moe_results, name):
    assert moe_results[name] == "ok", moe_results[name]


def test_every_moe_check_is_listed(moe_results):
    assert sorted(moe_results) == sorted(NAMES)


def test_moe_checks_fail_on_the_stock_tree(stock_site, tmp_path_factory):
    results = run_moe_checks(stock_site, tmp_path_factory.mktemp("moe-stock"))
    passing = sorted(n for n, r in results.items() if r == "ok")
    assert passing == [], passing


# --- contract with the pinned b12x, read from the overlay's own source -----------------------

def _overlay_module_source() -> str:
    """The new b12x experts module, as the 0004 patch adds it."""
    text = (OVERLAY_DIR / "0004-b12x-mxfp4-moe-backend.patch").read_text()
    marker = "+++ b/vllm/model_executor/layers/fused_moe/experts/b12x_mxfp4_moe.py\n"
    body = text.split(marker, 1)[1].split("\ndiff --git", 1)[0]
    lines = [ln[1:] for ln in body.splitlines() if ln.startswith("+")]
    return "\n".join(lines) + "\n"


def _helpers_source() -> str:
    text = (OVERLAY_DIR / "0001-spark-sm12x-helpers.patch").read_text()
    body = text.split("+++ b/vllm/utils/spark_sm12x.py\n", 1)[1]
    return "\n".join(ln[1:] for ln in body.splitlines() if ln.startswith("+")) + "\n"


def _api_calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "api"]


def test_pinned_b12x_is_the_locked_release():
    root = contract.source_root()
    dist = [p.name for p in root.glob("b12x-*.dist-info")]
    assert dist == [f"b12x-{contract.pinned_version()}.dist-info"], dist


def test_every_api_call_names_a_public_entry_point_and_binds():
    tree = ast.parse(_overlay_module_source())
    calls = _api_calls(tree)
    assert calls, "the backend makes no b12x calls"
    public = set(contract.api_entry_points())
    for call in calls:
        name = call.func.attr
        assert name in public, f"b12x.moe.fused_moe.api has no {name}"
        assert name != "route", "route is b12x's gate/top-k router, not route packing"
        if name == "Caps":
            sig = contract.dataclass_signature(contract.IMPL, "TPMoEScratchCaps")
        else:
            sig = contract.api_signature(name)
        if any(isinstance(k, ast.keyword) and k.arg is None for k in call.keywords):
            continue  # **kwargs spread: bound at run time by the vLLM-path checks
        sig.bind(*[object() for _ in call.args], **{k.arg: object() for k in call.keywords})


def test_plan_bind_keywords_bind_to_the_real_plan():
    """``api.bind(plan, **kw)`` forwards to ``TPMoEScratchPlan.bind``: check those names."""
    tree = ast.parse(_overlay_module_source())
    sig = contract.function_signature(contract.IMPL, "TPMoEScratchPlan.bind")
    binds = [c for c in _api_calls(tree) if c.func.attr == "bind"]
    assert binds
    for call in binds:
        sig.bind(**{k.arg: object() for k in call.keywords})


def test_mode_and_format_strings_are_b12x_vocabulary():
    helpers = ast.parse(_helpers_source())
    consts = {}
    for node in helpers.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                consts[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    vocab = contract.vocabulary()
    assert consts["B12X_MXFP4_SOURCE_FORMAT"] in vocab["source_format"]
    assert consts["B12X_W4A16_QUANT_MODE"] in vocab["quant_mode"]
    assert consts["B12X_W13_LAYOUT"] in vocab["w13_layout"]
    assert set(consts["B12X_ACTIVATIONS"].values()) <= vocab["activation"]
    assert contract.valid_source_and_mode(consts["B12X_MXFP4_SOURCE_FORMAT"],
                                          consts["B12X_W4A16_QUANT_MODE"])
    # The rule restated in b12x_contract is b12x's own (its text is unchanged).
    rule = contract.validation_rule_source()
    for fragment in ("if quant_mode == 'w4a16':", "if source_format == 'modelopt_nvfp4':",
                     "source_format == 'fp4_e8m0_k32' and quant_mode == 'w4a8_mx'"):
        assert fragment in rule, fragment
    # What the old series passed is not b12x vocabulary (the defect this replaces).
    assert "mxfp4" not in vocab["source_format"] and "swiglu_oai" not in vocab["activation"]


def test_eager_modules_exist_in_the_pinned_b12x():
    tree = ast.parse(_overlay_module_source())
    names = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 and getattr(n.targets[0], "id", None) == "B12X_MOE_MODULES")
    missing = [m for m in names if not contract.module_exists(m)]
    assert not missing, missing
    # Every b12x module the fused-MoE implementation imports lazily is in the list.
    impl = ast.parse(contract._module_file(contract.IMPL).read_text())
    lazy = {n.module for n in ast.walk(impl) if isinstance(n, ast.ImportFrom)
            and n.module and n.module.startswith("b12x.moe._shared.kernels.")
            and n.col_offset > 0}
    used = {m for m in lazy if m.startswith("b12x.moe._shared.kernels.w4a16")
            or m.endswith("tiny_decode")}
    assert used <= set(names), sorted(used - set(names))


def test_every_b12x_caller_of_the_tile_selector_drops_its_blocks_per_sm():
    """Why VLLM_B12X_W4A16_FORCE_BLOCKS_PER_SM is refused rather than wrapped in: in the
    pinned b12x every call of the W4A16 ``_select_tile_config`` (outside the selector itself)
    unpacks four values and discards the fourth; the kernel computes its blocks per SM in
    its constructor (``_determine_blocks_per_sm``)."""
    root = contract.source_root()
    calls = []
    # Each file parsed once; a file without the name in its text can neither call nor name it.
    texts = [(path, path.read_text()) for path in sorted((root / "b12x").rglob("*.py"))]
    trees = [(path, ast.parse(text)) for path, text in texts if "_select_tile_config" in text]
    for path, tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Call):
                continue
            func = node.value.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name != "_select_tile_config":
                continue
            (target,) = node.targets
            assert isinstance(target, ast.Tuple) and len(target.elts) == 4, ast.unparse(node)
            last = target.elts[3]
            assert isinstance(last, ast.Name) and last.id == "_", (path, ast.unparse(node))
            calls.append((path.name, node.lineno))
    # Any other use of the selector (an expression statement, an argument) would not be an
    # Assign; count every reference to be sure none escaped the check above.
    refs = [(p.name, n.lineno) for p, tree in trees
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None))
            == "_select_tile_config"]
    assert calls and sorted(calls) == sorted(refs), (calls, refs)
    kernel = ast.parse(contract._module_file(contract.W4A16_KERNEL).read_text())
    init = next(n for n in ast.walk(kernel) if isinstance(n, ast.FunctionDef)
                and n.name == "__init__" and "self.blocks_per_sm = _determine_blocks_per_sm("
                in ast.unparse(n))
    assert init is not None
