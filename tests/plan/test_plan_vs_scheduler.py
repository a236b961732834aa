"""`dspark plan`'s context at max_num_seqs against vLLM 0.28.0's own scheduler.

benchmarks/plan_vs_scheduler.py plans the published DeepSeek V4 Flash checkpoint on a grid of
settings and drives vLLM's real Scheduler / KVCacheManager on CPU with each plan's pool
(tests/overlay/scheduler_sim.py: overlay applied to a copy of the installed vLLM, SM12x
simulated, a real SpeculativeConfig for DSpark, prefix caching on, fake model outputs, two
batches in flight), each length with the requests sent together and with the last one sent
once the others decode. The plan's figure must be at most vLLM's (every length tried at or
below it keeps all max_num_seqs requests resident) and within 5% of it. CI runs four points of
the grid, with fewer lengths tried below the plan than the benchmark: 0.78 x 12 (the figure
that was 6x too low), 0.835 x 32 (too low), the serving default 0.835 x 12 (above vLLM at
the issue's plan), 0.78 x 4 (above vLLM while the plan let four requests that all fit the
first step's budget skip the late request's admission cap) and 0.7 x 16 (a pool of 1,144 blocks
where all sixteen prompts prefill in one step: every length from 10% below the plan to 5% above
is tried, since vLLM preempts there in bands a few tokens wide). The benchmark prints the whole
grid.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from benchmarks import plan_vs_scheduler as pvs

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm  # vLLM's own scheduler and KV-cache manager, on a copy of its tree

CI_POINTS = ("0.78 x 12", "0.835 x 32", "0.835 x 12", "0.78 x 4", "0.7 x 16")
CI_BELOW = (0.98, 0.95)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    from dspark.lines.overlay import apply_series

    overlay = pvs.overlay_conftest()
    copy_vllm_tree, installed_site_packages = overlay.copy_vllm_tree, overlay.installed_site_packages
    site = tmp_path_factory.mktemp("sched-site")
    copy_vllm_tree(installed_site_packages(), site)
    apply_series(site, pvs.OVERLAY_DIR)
    try:
        return {r["setting"]: r for r in pvs.compare(list(CI_POINTS), site=site, timeout=900,
                                                      below=CI_BELOW, phases=1)}
    finally:
        shutil.rmtree(site, ignore_errors=True)


@pytest.mark.parametrize("setting", CI_POINTS)
def test_plan_is_at_most_vllm_and_within_5_percent(rows, setting):
    row = rows[setting]
    assert pvs.verdict(row) == [], pvs.table([row])


def test_the_default_is_one_of_the_points_and_the_grid_is_the_issues():
    from dspark.plan.published import plan_published

    names = dict(pvs.SETTINGS)
    base = plan_published().inputs
    assert (base.gpu_memory_utilization, base.max_num_seqs) == (0.835, 12)
    assert len(pvs.SETTINGS) >= 20 and set(CI_POINTS) <= set(names) and "0.835 x 12" in names
    assert {f"{u} x {n}" for u in (0.70, 0.78, 0.835, 0.90) for n in (4, 12, 16, 32)} <= set(names)
    assert {"max_model_len 131,072", "max_model_len 1,048,576",
            "max_num_batched_tokens 2,048"} <= set(names)
