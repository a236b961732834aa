"""The patched vLLM modules, run in a subprocess on the patched copy."""

from __future__ import annotations

import pytest

from .conftest import run_checks

NAMES = (
    "imports",
    "tensor_logic",
    "cache_dtype",
    "nvfp4_rewrite",
    "page_size_specs",
    "flashinfer_backend",
    "b12x_backend",
    "b12x_env",
    "out_op_optional",
    "warmup_prompt_len",
)


@pytest.mark.parametrize("name", NAMES)
def test_patched_behaviour(patched_results, name):
    assert patched_results[name] == "ok", patched_results[name]


def test_every_check_is_listed(patched_results):
    assert sorted(patched_results) == sorted(NAMES)


def test_checks_fail_on_the_stock_tree(stock_site):
    # The same checks against unpatched vLLM: they must notice the difference.
    results = run_checks(stock_site)
    failing = {name for name, result in results.items() if result != "ok"}
    assert failing == set(NAMES), sorted(set(NAMES) - failing)
