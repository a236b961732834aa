"""`dspark plan`'s concurrency figures against vLLM 0.28.0's own scheduler.

benchmarks/plan_vs_scheduler.py plans the published DeepSeek V4 Flash checkpoint at the
serving defaults (read from dspark's config when the test runs) and at eight single
changes, then drives vLLM's real Scheduler / KVCacheManager on CPU
(tests/overlay/scheduler_sim.py: overlay applied to a copy of the installed vLLM, SM12x
simulated, fake model outputs, two batches in flight, no prefix hits) with each plan's pool.
Each figure must hold within 5%: max_num_seqs requests of 95% of the planned context run
at once without a preemption and of 105% do not; the planned number of full-max_model_len
requests runs, one more does not. One simulation process runs every case (a few minutes on
two cores).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import plan_vs_scheduler as pvs  # noqa: E402

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm  # vLLM's own scheduler and KV-cache manager, on a copy of its tree


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    from dspark.overlay import apply_series

    overlay = pvs.overlay_conftest()
    copy_vllm_tree, installed_site_packages = overlay.copy_vllm_tree, overlay.installed_site_packages
    site = tmp_path_factory.mktemp("sched-site")
    copy_vllm_tree(installed_site_packages(), site)
    apply_series(site, pvs.OVERLAY_DIR)
    try:
        return {r["setting"]: r for r in pvs.compare(rounds=0, site=site, timeout=1500)}
    finally:
        shutil.rmtree(site, ignore_errors=True)


@pytest.mark.parametrize("setting", [name for name, _ in pvs.SETTINGS])
def test_plan_matches_vllm_scheduler(rows, setting):
    row = rows[setting]
    assert pvs.verdict(row) == [], pvs.table([row])


def test_the_comparison_covers_the_settings_the_plan_must_hold_at():
    names = {n for n, _ in pvs.SETTINGS}
    assert {"defaults", "max_num_seqs 4", "max_num_seqs 16", "max_model_len 131,072",
            "max_model_len 1,048,576", "max_num_batched_tokens 2,048", "async scheduling off",
            "TP=4"} <= names
