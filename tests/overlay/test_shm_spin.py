"""Patch 0013 through vLLM's own MessageQueue between two processes (spin_checks.py): the reader
vLLM builds busy-loops for VLLM_SHM_BROADCAST_BUSY_LOOP_S (0.002 s unset, 1 s as stock vLLM when
set to 1), read through vllm.envs, and a bad value stops the reader's construction with an error
naming the variable; stock vLLM ignores the variable and spins 1 s. The variable's registration
(vLLM's validate_environ) is moe_checks.check_env_registered's (test_moe_b12x.py)."""

from __future__ import annotations

import json
from pathlib import Path

from .conftest import run_checks

CHECKS = Path(__file__).with_name("spin_checks.py")
ENV = "VLLM_SHM_BROADCAST_BUSY_LOOP_S"


def spin_results(site: Path, **kwargs) -> dict[str, dict]:
    raw = run_checks(site, CHECKS, timeout=600, **kwargs)
    return {k: json.loads(v) for k, v in raw.items()}


def check_patched(r: dict[str, dict]) -> None:
    unset, stock_value = r[f"{ENV} unset"], r[f"{ENV}=1"]
    assert unset["busy_loop_s"] == 0.002 and stock_value["busy_loop_s"] == 1.0, r
    # Both readers parked after their busy loop and woke on the writer's notify: the second
    # message arrived after the writer's 1.5 s pause, not later.
    for out in (unset, stock_value):
        assert 1.4 < out["wait_wall_s"] < 2.5, r
    # The CPU the reader used while it waited: 1 s spinning against 2 ms (a measurement on a shared
    # host: only the order is asserted).
    assert unset["wait_cpu_s"] < stock_value["wait_cpu_s"], r
    for bad in ("-1", "2ms"):
        error = r[f"{ENV}={bad}"].get("error", "")
        assert error.startswith(f"ValueError: {ENV}={bad!r}: ") and "finite number >= 0" in error, r
    assert r["compile_factors ignore it"] is True


def test_the_reader_busy_loops_for_the_configured_time(patched_site):
    check_patched(spin_results(patched_site))


def test_stock_vllm_spins_one_second_whatever_the_variable_says(stock_site):
    r = spin_results(stock_site)
    assert r[f"{ENV} unset"]["busy_loop_s"] == 1 and r[f"{ENV}=1"]["busy_loop_s"] == 1, r
    assert all("error" not in r[f"{ENV}={bad}"] and r[f"{ENV}={bad}"]["busy_loop_s"] == 1 for bad in ("-1", "2ms")), r


def test_the_v032_line_reads_the_variable_too(patched_site_032, python_032):
    check_patched(spin_results(patched_site_032, python=python_032))
