"""The stages vLLM's log announces (starting -> rendezvous -> loading -> warming), in order: pure
helpers for the vLLM child (dspark.node.vllm_process reads its log) and the policy
(dspark.node.policy shows them)."""

from __future__ import annotations

from dspark.engine import facts as vllm_facts


def later(stage: str, current: str) -> bool:
    order = vllm_facts.STAGE_ORDER
    return order.index(stage) > order.index(current) if current in order else False


def at_least(stage: str, floor: str) -> bool:
    order = vllm_facts.STAGE_ORDER
    return stage in order and order.index(stage) >= order.index(floor)


def stage_detail(stage: str) -> str:
    return {
        "rendezvous": "vLLM is in the rendezvous",
        "loading": "loading the model",
        "warming": "warming up (profiling, compiling, capturing graphs)",
    }.get(stage, "")


def next_stage(line: str, current: str) -> str:
    """The stage after reading `line` (stages only move forward)."""
    for marker, stage in vllm_facts.LOG_STAGES:
        if marker in line and later(stage, current):
            current = stage
    return current
