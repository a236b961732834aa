"""The attention helpers of overlay/0003 (vllm/utils/spark_sm12x_attn.py) on
CPU tensors, loaded straight out of the patch (no vLLM needed)."""

from __future__ import annotations

import pytest

from .attn_tensor_checks import CHECKS, run_all
from .run_cuda_checks import load_module


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_all(load_module(tmp_path_factory.mktemp("attn"), "spark_sm12x_attn"), "cpu")


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_attn_helper(results, name):
    assert results[name] == "ok", results[name]
