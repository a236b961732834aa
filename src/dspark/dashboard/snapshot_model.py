"""The dashboard's snapshot (GET /api/v1/snapshot) declared once, as dataclasses: the JSON
Schema the server publishes (/static/snapshot.schema.json) is generated from these declarations
by dspark.config.typecheck.json_schema. The collector (dashboard/collector.py) builds the snapshot as
plain dicts; the tests validate what it builds against this schema.

"{what}" in a description is filled in by the field that holds the dataclass (the three latency
figures share LatencyStats, the two rates Rate)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from dspark.config.typecheck import about, json_schema
from dspark.node import states as S

SCHEMA_ID = "dspark-dashboard-snapshot-v1"
UNREACHABLE = "unreachable"  # a node state of the dashboard's own: an agent that never answered


@dataclass
class Switch:
    id: str = about(
        'the switch\'s id in dspark switch --history ("-rollback" appended for its rollback); empty '
        "when the head gave none")
    from_: str = about("the line the pair leaves", minLength=1, key="from")
    to: str = about("the line the pair moves to (on a rollback: the line it returns to)", minLength=1)
    rollback: bool = about("true when this is the rollback of a failed or regressed switch")
    at: float | None = about("unix time the switch (or rollback) started, by the head's clock")
    for_s: float | None = about(
        "seconds since it started (dashboard's clock against the head's at)",
        minimum=0)


@dataclass
class RuntimeLine:
    head: str | None = about(
        'the line the head\'s agent reports it runs (e.g. "v0.32.0"); null when the head\'s agent is '
        "lost or predates runtime lines",
        minLength=1)
    mixed: bool = about(
        "some node runs another line than the head's (its other_line is true); a pair does not form "
        "on two lines, and during a switch the worker follows the head")
    switch: Switch | None = about(
        "the switch (or its rollback) under way, from the head's state (dspark.lines.state); null when"
        " none")


@dataclass
class Rate:
    current: float | None = about(
        "{what} tokens/s over the last poll interval, tokens/s (null until two scrapes)",
        minimum=0)
    active_avg: float | None = about(
        "mean {what} tokens/s over the active, non-zero intervals since the dashboard started (an "
        "interval is active when a request ran or more tokens than the liveness probe's one went "
        "through)",
        minimum=0)


@dataclass
class Throughput:
    decode_tps: Rate = about(what="generated")
    prefill_tps: Rate = about(what="prompt")


@dataclass
class Tokens:
    prompt_total: float | None = about("prompt tokens since vLLM started", minimum=0)
    generation_total: float | None = about("generated tokens since vLLM started", minimum=0)
    requests_finished: float | None = about("finished requests, every reason", minimum=0)
    preemptions: float | None = about("preempted requests", minimum=0)


@dataclass
class Requests:
    running: float | None = about("requests being decoded", minimum=0)
    waiting: float | None = about("requests queued", minimum=0)


@dataclass
class LatencyStats:
    window_mean: float | None = about(
        "mean {what} over the window, seconds (null when no request finished in it)",
        minimum=0)
    p50: float | None = about(
        "median {what} over the window, seconds: an estimate from vLLM's histogram buckets "
        "(Prometheus' interpolation kept inside p50_range; where that range allows both, never above "
        "window_mean)",
        minimum=0)
    p95: float | None = about(
        "95th percentile {what} over the window, seconds: an estimate from vLLM's histogram buckets, "
        "kept inside p95_range and at least p50",
        minimum=0)
    lifetime_mean: float | None = about("mean {what} since vLLM started, seconds", minimum=0)
    count: int = about("observations of {what} in the window", minimum=0)
    p50_range: list[float | None] | None = about(
        "[low, high] seconds: where the window's p50 provably lies, from the buckets narrowed by the "
        "exact sum (high null: unbounded); null when nothing finished in the window",
        minItems=2, maxItems=2, minimum=0)
    p50_bucket: list[float | None] | None = about(
        "[lower, upper] seconds of vLLM's bucket(s) holding the p50 (upper null: +Inf); the bucket "
        "width the estimate comes from",
        minItems=2, maxItems=2, minimum=0)
    p95_range: list[float | None] | None = about(
        "[low, high] seconds: where the window's p95 provably lies, from the buckets narrowed by the "
        "exact sum (high null: unbounded); null when nothing finished in the window",
        minItems=2, maxItems=2, minimum=0)
    p95_bucket: list[float | None] | None = about(
        "[lower, upper] seconds of vLLM's bucket(s) holding the p95 (upper null: +Inf); the bucket "
        "width the estimate comes from",
        minItems=2, maxItems=2, minimum=0)


@dataclass
class Latency:
    window_s: float | None = about("seconds the window covers (up to 60)", minimum=0)
    ttft_s: LatencyStats = about(what="time to first token")
    itl_s: LatencyStats = about(what="inter-token latency")
    e2e_s: LatencyStats = about(what="end-to-end request latency")


@dataclass
class AcceptanceRate:
    current: float | None = about("accepted/drafted tokens over the last interval")
    lifetime: float | None = about("accepted/drafted tokens since vLLM started")


@dataclass
class SpecDecode:
    acceptance_rate: AcceptanceRate = about()
    mean_acceptance_length: float | None = about(
        "1 + accepted tokens per draft (vLLM's definition)",
        minimum=0)
    draft_tokens: float | None = about("drafted tokens since vLLM started", minimum=0)
    accepted_tokens: float | None = about("accepted tokens since vLLM started", minimum=0)


@dataclass
class Finished:
    per_s: float | None = about(
        "finished requests per second over the last poll interval, every reason, the head's liveness "
        "probes included (null until two scrapes)",
        minimum=0)
    window_per_s: float | None = about("finished requests per second over the window", minimum=0)
    window_s: float | None = about("seconds the window covers (up to 60; the latency window)", minimum=0)
    total: float | None = about("finished requests since vLLM started (vllm:request_success)", minimum=0)
    errors_total: float | None = about(
        'requests that finished with an error since vLLM started (finished_reason="error": a request-level '
        "internal error, answered HTTP 500); null when vLLM does not label why a request finished",
        minimum=0)
    aborts_total: float | None = about(
        'requests aborted since vLLM started (finished_reason="abort": the client went away, or a stop '
        "cut them short); null when vLLM does not label why",
        minimum=0)
    errors_window: float | None = about("errors in the window", minimum=0)
    aborts_window: float | None = about("aborts in the window", minimum=0)
    errors_interval: float | None = about("errors in the last poll interval", minimum=0)
    aborts_interval: float | None = about("aborts in the last poll interval", minimum=0)


@dataclass
class Vllm:
    available: bool = about(
        "false when /metrics was unreachable, not HTTP 200, or not parseable vLLM metrics")
    error: str | None = about("why unavailable")
    url: str = about("the head's API the dashboard polls (the browser never does)")
    version: str | None = about("vLLM version, from the node agents (or vLLM's /version)")
    counter_resets: int = about(
        "vLLM restarts seen (counters went back to zero); rates stay non-negative",
        minimum=0)
    throughput: Throughput | None = about()
    tokens: Tokens | None = about()
    requests: Requests | None = about()
    kv_cache_usage: float | None = about("KV-cache blocks in use, 0..1", minimum=0, maximum=1)
    latency: Latency | None = about()
    spec_decode: SpecDecode | None = about("null when vLLM runs without speculative decoding")
    idle: bool | None = about(
        "nothing running or waiting in this scrape: the figures that still move are the head's "
        "liveness probes")
    finished: Finished | None = about(
        "request rate, errors and aborts (vllm:request_success by finished_reason); null while "
        "vLLM is unavailable")


@dataclass
class Liveness:
    ok: bool = about()
    proof: Literal["progress", "probe"] | None = about()
    proof_age_s: float | None = about(minimum=0)
    proof_detail: str = about()


@dataclass
class Gpu:
    name: str | None = about()
    temperature_c: float | None = about("GPU temperature, °C")
    power_w: float | None = about("board power, W", minimum=0)
    utilization_pct: float | None = about(minimum=0, maximum=100)


@dataclass
class Hardware:
    source: Literal["agent", "local"] | None = about(
        "who read it: the node's agent, this dashboard's host, or nobody (all n/a)")
    gpus: list[Gpu] = about("one entry per GPU; empty when NVML is absent or finds none (shown n/a)")
    nvme_temperature_c: float | None = about(
        "hottest NVMe composite temperature from sysfs hwmon, °C; null when none")


@dataclass
class Memory:
    total_bytes: int = about("the host's memory; on a GB10 the unified memory CPU and GPU share", minimum=1)
    used_bytes: int = about("in use: total - available", minimum=0)
    available_bytes: int = about(
        "what a new allocation can still get without swapping (MemAvailable; NVML's free)", minimum=0)
    source: Literal["nvml", "meminfo"] = about(
        "nvml: the GPU's NVML answered; meminfo: the kernel's /proc/meminfo (dspark.node.host_memory)")


@dataclass
class Node:
    name: str = about()
    rank: int = about(minimum=0)
    role: Literal["head", "worker"] = about()
    agent_url: str = about()
    reachable: bool = about("the agent answered this round")
    state: str = about(
        "the agent's state; 'failed' also when an agent that answered before has been silent for 2 s "
        "or more (its supervisor exited); 'unreachable' when it never answered",
        enum=[*S.STATES, UNREACHABLE])
    detail: str = about()
    silent_s: float | None = about(
        "seconds since the agent last answered (0 when it answered this round; null if never)",
        minimum=0)
    restarts: int | None = about(minimum=0)
    vllm_pid: int | None = about()
    vllm_version: str | None = about()
    runtime_line: str | None = about(
        "the runtime line this node runs, from its agent's last answer (null from an agent that "
        "predates runtime lines)",
        minLength=1)
    file_line: str | None = about(
        "the cluster file's line (serving.runtime_line) as the node's agent last reported it; differs"
        " from runtime_line after dspark switch moved the pair",
        minLength=1)
    other_line: bool = about(
        "this node's agent (answering, or within its grace) reports another line than the head's; "
        "false for the head, and when either line is unknown")
    uptime_s: float | None = about("seconds since the node's supervisor started", minimum=0)
    liveness: Liveness | None = about(
        "the head's liveness (null on a worker, or before the first round): whether the last round "
        "found the engine alive, and the last proof of life: 'progress' (vLLM's token counters or "
        "KV-cache usage moved while requests ran or waited) or 'probe' (a 1-token completion while "
        "idle)")
    hardware: Hardware = about()
    memory: Memory | None = about(
        "the node's memory as its agent last reported it; null when the agent does not report it")


@dataclass
class QuantileHistory:
    p50_low: list[float | None] = about(
        "per poll: the low end of the range the window's p50 {what} provably lies in (rates.quantile_range), "
        "seconds; null when nothing finished in the window",
        minimum=0)
    p50_high: list[float | None] = about("per poll: its high end (null: unbounded, or nothing finished)", minimum=0)
    p95_low: list[float | None] = about("per poll: the low end of the p95's range, seconds", minimum=0)
    p95_high: list[float | None] = about("per poll: its high end (null: unbounded, or nothing finished)", minimum=0)


@dataclass
class LatencyHistory:
    ttft_s: QuantileHistory = about(what="time to first token")
    itl_s: QuantileHistory = about(what="inter-token latency")
    e2e_s: QuantileHistory = about(what="end-to-end latency")


@dataclass
class History:
    capacity: int = about("the most points kept (one per poll)", minimum=1)
    t: list[float] = about("unix time of each point")
    decode_tps: list[float | None] = about("decode tokens/s per poll; null where unknown", minimum=0)
    prefill_tps: list[float | None] = about("prompt tokens/s per poll; null where unknown", minimum=0)
    running: list[float | None] = about("running requests", minimum=0)
    waiting: list[float | None] = about("waiting requests", minimum=0)
    kv_cache_usage: list[float | None] = about("KV-cache usage 0..1", minimum=0, maximum=1)
    requests_per_s: list[float | None] = about("finished requests per second per poll", minimum=0)
    errors: list[float | None] = about(
        "requests that finished with an error in each poll interval; null where vLLM does not say",
        minimum=0)
    aborts: list[float | None] = about("requests aborted in each poll interval", minimum=0)
    latency: LatencyHistory = about(
        "the p50 and p95 ranges of each latency over the (60 s) window, per poll, one list per bound")


@dataclass
class Event:
    at: float = about("unix time of the event, by the clock of the node that recorded it", exclusiveMinimum=0)
    node: str = about("the node it happened on")
    kind: str = about(
        "start, restart, switch, backoff, stage, serving, liveness, drain, stopping, stopped, failed "
        "(dspark.node.states.EVENT_KINDS, from the node's agent), or lost (the dashboard's own: the agent "
        "went silent without a word)",
        minLength=1, maxLength=32)
    detail: str = about()
    by: Literal["node", "dashboard"] = about("who recorded it: the node's supervisor, or this dashboard")


@dataclass
class Snapshot:
    schema_version: Literal[1] = about()
    generated_at: float = about("unix time of this snapshot")
    interval_s: float = about("seconds between polls", exclusiveMinimum=0)
    round: int = about("polls done since the dashboard started", minimum=0)
    serving: bool = about("vLLM's metrics answered and every node's agent reports serving")
    model: str | None = about(
        "the served model name clients send (the cluster file's model.served_name)",
        optional=True)
    liveness_interval_s: float | None = about(
        "seconds between the head's 1-token liveness probes, which it sends only while the engine is "
        "idle (they show as about 1 generated token and 1 finished request per interval)",
        optional=True)
    runtime_line: RuntimeLine = about(
        "the runtime line the pair runs (dspark switch moves a serving pair to another installed "
        "line), as the node agents report it")
    collector_error: str = about(
        "present only if the last round raised; the page keeps updating",
        optional=True)
    vllm: Vllm = about()
    nodes: list[Node] = about("every node of the cluster file, by rank")
    history: History = about()
    events: list[Event] = about(
        "the timeline, oldest first: the nodes' events (each agent serves its last 64) merged, and "
        "the dashboard's own; the newest 100")


def snapshot_schema() -> dict:
    """The JSON Schema of a snapshot."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "dspark dashboard snapshot (GET /api/v1/snapshot)",
        "description": ("What the dashboard's single collector saw in its latest round. Numbers the "
                        "collector does not know are null; the vLLM sections are null when "
                        "vllm.available is false."),
        **json_schema(Snapshot),
    }


def schema_json() -> bytes:
    """The schema as the server sends it."""
    return json.dumps(snapshot_schema(), indent=1, ensure_ascii=False).encode() + b"\n"
