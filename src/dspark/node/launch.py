"""Cluster + node -> the exact vLLM command line and environment. Pure functions."""

from __future__ import annotations

import json
import math
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.config.checks import ENV_NAME
from dspark.config.flags import Flag, Form, of_form
from dspark.config.schema import Cluster, NodeConfig
from dspark.config.secret_policy import redact_args, redact_env
from dspark.lines import runtime as runtime_lines


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]  # added to the supervisor's environment for vLLM

    def redacted_env(self) -> dict[str, str]:
        """The environment with every secret's value (dspark.config.secret_policy) replaced."""
        return redact_env(self.env)

    def redacted_argv(self) -> list[str]:
        """The command line with the value of every secret option replaced (for logs)."""
        return redact_args(self.argv)

    def shell(self) -> str:
        """A copy-pasteable rendering, one flag and its value per line (secrets redacted).
        A name that is not a shell variable name (the cluster file refuses those) goes through
        env(1), quoted, so pasting the output never runs anything but vLLM."""
        env = sorted(self.redacted_env().items())
        if all(ENV_NAME.fullmatch(k) for k, _ in env):
            lines = [f"{k}={shlex.quote(v)}" for k, v in env]
        else:
            lines = ["env"] + [shlex.quote(f"{k}={v}") for k, v in env]
        words: list[str] = []
        for arg in self.redacted_argv():
            # a flag and all its values on one line (--cudagraph-capture-sizes takes several)
            if words and words[-1].startswith("--") and not arg.startswith("--"):
                words[-1] += " " + shlex.quote(arg)
            else:
                words.append(shlex.quote(arg))
        return " \\\n".join(lines + [words[0]] + ["  " + w for w in words[1:]]) + "\n"


# ASGI middleware vLLM's API server loads (dspark/data/vllm_middleware/dspark_api_guard.py): the API
# key on every route but /health.
API_GUARD_DIR = Path(__file__).resolve().parent.parent / "data" / "vllm_middleware"
API_GUARD = "dspark_api_guard.GuardEveryRoute"


def line_settings(cluster: Cluster) -> runtime_lines.Rendered:
    """The cluster's line-dependent settings in its runtime line's names (and the environment the
    line adds for them); raises runtime_lines.LineRefusal for a setting the line cannot honour."""
    s = cluster.serving
    line = runtime_lines.load().get(s.runtime_line)
    return runtime_lines.render_settings(line, {k: getattr(s, k) for k in runtime_lines.SETTINGS})


def node_env(cluster: Cluster, node: NodeConfig, gid_index: str | None = None) -> dict[str, str]:
    """Environment for vLLM on `node`: what the runtime line adds for the settings, the shared
    env, the fabric settings, the node's own env (each later one wins)."""
    env = dict(line_settings(cluster).env)
    env.update(cluster.serving.env)
    env["VLLM_HOST_IP"] = node.address
    if node.socket_ifname:
        for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
            env[key] = node.socket_ifname
    if node.rdma_device:
        env["NCCL_IB_HCA"] = node.rdma_device
    gid = gid_index if gid_index is not None else node.gid_index
    if gid is not None and gid != "auto":
        env["NCCL_IB_GID_INDEX"] = gid
    env.update(node.env)
    # vLLM imports dspark's API guard (--middleware, vllm_argv) from this directory, ahead of any
    # path the cluster file gives.
    env["PYTHONPATH"] = os.pathsep.join([str(API_GUARD_DIR), *filter(None, [env.get("PYTHONPATH")])])
    return env


def vllm_argv(cluster: Cluster, node: NodeConfig) -> list[str]:
    m, s = cluster.model, cluster.serving
    head = cluster.head
    named = line_settings(cluster).values  # kv_cache_dtype, moe_backend in the line's names
    argv = [*s.vllm_command, "serve", m.path, "--served-model-name", m.served_name]
    if m.trust_remote_code:
        argv.append("--trust-remote-code")
    if node.is_head:
        argv += ["--host", node.api_bind, "--port", str(node.api_port)]
    argv += [
        "--tensor-parallel-size", str(s.tensor_parallel_size),
        "--pipeline-parallel-size", str(s.pipeline_parallel_size),
    ]
    # The serving fields' options, in the order of the one table (dspark.config.flags), which the
    # validator also reads to refuse them in extra_args.
    value: dict[str, Any] = {
        # in the line's own names
        "kv_cache_dtype": named["kv_cache_dtype"], "moe_backend": named["moe_backend"],
        # With speculative decoding the sizes themselves (every multiple of the verify rows per
        # request, config.ServingConfig.capture_sizes); vLLM takes the largest as the maximum.
        "max_cudagraph_capture_size": s.cudagraph_capture_size if s.capture_sizes is None else None,
        "cudagraph_capture_sizes": s.capture_sizes,
        # vLLM takes kv_cache_memory_bytes instead of the utilization when both are given;
        # pass only the one that applies so the command line says what happens.
        "gpu_memory_utilization": None if s.kv_cache_memory_bytes is not None else s.gpu_memory_utilization,
        # an empty table is no draft: nothing written (a limit_mm_per_prompt of {} is written)
        "speculative_config": s.speculative_config or None,
    }

    def setting(flag: Flag) -> Any:
        return value[flag.attr] if flag.attr in value else getattr(s, flag.attr)

    for flag in of_form(Form.VALUE):
        if (v := setting(flag)) is not None:
            argv += [flag.option, str(v)]
    for flag in of_form(Form.LIST):
        if (v := setting(flag)) is not None:
            argv += [flag.option, *map(str, v)]
    argv += [flag.option for flag in of_form(Form.SWITCH) if setting(flag)]
    for flag in of_form(Form.JSON):
        if (v := setting(flag)) is not None:
            argv += [flag.option, json.dumps(v, separators=(",", ":"))]
    if node.is_head:
        # vLLM's own key check guards /v1 only, and its CORS default lets every origin in: the
        # key guards every route but /health (API_GUARD), and only the origins the cluster file
        # names may call the API from a browser.
        argv += ["--middleware", API_GUARD, "--allowed-origins", json.dumps(s.allowed_origins)]
    argv += ["--distributed-executor-backend", "mp"]
    if len(cluster.nodes) > 1:
        argv += [
            "--nnodes", str(len(cluster.nodes)),
            "--node-rank", str(node.rank),
            "--master-addr", head.address,
            "--master-port", str(head.master_port),
        ]
        if not node.is_head:
            argv.append("--headless")
    drain_s = cluster.supervisor.drain_s
    if node.is_head and drain_s > 0:
        # On SIGTERM vLLM turns new requests away and lets those in flight finish for this long
        # (whole seconds: vLLM's option takes an int) before it aborts them; 0 aborts at once.
        # The supervisor sends that SIGTERM only on a planned stop (dspark.node.policy).
        argv += ["--shutdown-timeout", str(math.ceil(drain_s))]
    argv += list(s.extra_args)
    return argv


def render(cluster: Cluster, node: NodeConfig, gid_index: str | None = None) -> Launch:
    """The launch of vLLM on `node`. `gid_index` is the resolved RoCE GID when the node says 'auto'."""
    return Launch(argv=vllm_argv(cluster, node), env=node_env(cluster, node, gid_index))
