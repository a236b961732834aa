"""The plan's defaults are the cluster file's: one fact, one place."""

import dataclasses

from dspark.config import validate as C
from dspark.config.schema import ServingConfig
from dspark.plan.facts import serving_default
from dspark.plan.from_cluster import plan_inputs
from dspark.plan.inputs import PlanInputs


def test_plan_inputs_default_to_the_config_defaults(tmp_path):
    defaults = PlanInputs(tmp_path, 2)
    serving = {f.name: f.default for f in dataclasses.fields(ServingConfig)
               if f.default is not dataclasses.MISSING}
    assert defaults.gpu_memory_utilization == serving["gpu_memory_utilization"] == 0.835
    assert defaults.max_model_len == serving["max_model_len"]
    assert defaults.max_num_seqs == serving["max_num_seqs"]
    assert defaults.max_num_batched_tokens == serving["max_num_batched_tokens"]
    assert defaults.async_scheduling == serving["async_scheduling"]
    assert defaults.usable_memory_bytes == int(serving["usable_memory_gib"] * (1 << 30))


def test_a_cluster_file_without_the_setting_plans_with_the_config_default(tmp_path):
    from tests.harness.standin import write_cluster

    cluster = C.load(write_cluster(tmp_path))
    assert plan_inputs(cluster).gpu_memory_utilization == serving_default("gpu_memory_utilization") == 0.835
