"""The comparison with a peer whose agent answers: same cluster file, runtime line, runtime and
model (this node's identity: dspark.preflight.identity), the same dspark, clocks within a
second."""

from __future__ import annotations

import time

from dspark.config.schema import Cluster, NodeConfig
from dspark.preflight.result import Check, fail, ok, warn

CLOCK_TOLERANCE_S = 1.0


def own_agent_state(node: NodeConfig) -> dict | None:
    """This node's /state when its own agent answers as this node (its dspark serve runs)."""
    from dspark.node.agent_client import agent_state

    s = agent_state(node.agent_url, timeout=1.0)
    return s if s is not None and s.get("node") == node.name else None


def check_peers(cluster: Cluster, node: NodeConfig, mine: dict, starting: bool = False) -> list[Check]:
    """Compare with every other node whose agent answers. `starting`: this node is about to
    start, when a worker does not expect its head yet (workers start first)."""
    from dspark.node.agent_client import fetch_state

    out: list[Check] = []
    for peer in cluster.nodes:
        if peer.name == node.name:
            continue
        t0 = time.time()
        answer = fetch_state(peer.agent_url, timeout=2.0)
        t1 = time.time()
        name = f"peer.{peer.name}"
        s = answer.state
        if s is None:
            if starting and peer.is_head and not node.is_head:
                out.append(ok(name, f"the head's agent ({peer.agent_url}) is not up: it starts after the workers and "
                              "compares itself with them then"))
            elif starting and not peer.is_head and not node.is_head:
                out.append(ok(name, f"{peer.name}'s agent ({peer.agent_url}) is not up: workers start in any "
                              "order, and the head compares itself with each of them when it starts"))
            else:
                out.append(warn(name, f"{peer.agent_url} does not answer ({answer.error or 'no state'}): cluster "
                                "file, runtime, model and clock not compared", f"start {peer.name} first "
                                "(workers before the head), or check the fabric between the nodes"))
            continue
        theirs = s.get("identity") or {}
        line = s.get("runtime_line") or theirs.get("runtime_line")
        follows = _follows(name, node, peer, mine, theirs, line)
        if not theirs:
            out.append(warn(name, f"{peer.name}'s agent reports no identity (an older dspark?)",
                            "install the same dspark on every node"))
        else:
            out += _compare(name, peer.name, mine, theirs, runtime=follows is None)
        out += [follows] if follows else _compare_line(name, peer.name, mine.get("runtime_line"), line)
        if s.get("dspark_version") and s.get("dspark_version") != _dspark_version():
            out.append(warn(f"{name}.dspark", f"{peer.name} runs dspark {s.get('dspark_version')}, this node "
                            f"{_dspark_version()}", "install the same dspark on every node"))
        peer_time = s.get("time")
        if isinstance(peer_time, (int, float)) and not isinstance(peer_time, bool):
            offset = peer_time - (t0 + t1) / 2
            bound = (t1 - t0) / 2
            seen = f"{peer.name}'s clock is {offset:+.3f} s from this node's (round trip {t1 - t0:.3f} s)"
            if abs(offset) - bound > CLOCK_TOLERANCE_S:
                out.append(warn(f"{name}.clock", seen + f", more than {CLOCK_TOLERANCE_S:g} s",
                                "run NTP on both nodes (`timedatectl set-ntp true`; chrony or systemd-timesyncd)"))
            else:
                out.append(ok(f"{name}.clock", seen))
    return out


def _dspark_version() -> str:
    from dspark import __version__

    return __version__


def _compare_line(name: str, peer: str, mine: str | None, theirs: str | None) -> list[Check]:
    """The runtime line each node runs: one pair, one line (an engine cannot span two releases)."""
    label = f"{name}.line"
    theirs = theirs if isinstance(theirs, str) and theirs else None
    if not mine and not theirs:
        return []  # neither side names one (identities from before runtime lines): the runtime row compares
    if not mine or not theirs:
        return [warn(label, f"runtime line not known on {'this node' if not mine else peer} (an older dspark?)",
                     "install the same dspark on every node")]
    if mine != theirs:
        return [fail(label, f"{peer} runs runtime line {theirs}, this node {mine}: a pair does not form on two lines",
                     "put every node on one line: the same serving.runtime_line (the same cluster file) on "
                     "every node, then restart the workers first, the head last")]
    return [ok(label, f"same runtime line as {peer}: {mine}")]


def _follows(name: str, node: NodeConfig, peer: NodeConfig, mine: dict, theirs: dict, line: object) -> Check | None:
    """Two lines of one cluster file are not a refusal: the workers follow their head's line when
    the pair forms (node_policy: a worker switches to it, the head does not refuse it). So a node
    restarted on its own while the pair switches lines, or rolls a switch back, rejoins; a refusal
    (exit 2) is never restarted by systemd. The runtimes then differ as their lines do, and are
    compared once both run one line."""
    mine_line, sha = mine.get("runtime_line"), mine.get("cluster_sha256")
    if (not isinstance(line, str) or not line or not mine_line or line == mine_line or not sha
            or sha != theirs.get("cluster_sha256")):
        return None
    onto = (f"this worker follows its head onto {line}" if peer.is_head else
            f"{peer.name} follows this head onto {mine_line}" if node.is_head else "both follow the head's line")
    return ok(f"{name}.line", f"{peer.name} runs runtime line {line}, this node {mine_line}, from the same cluster "
              f"file: {onto} when the pair forms (runtimes compared once both run one line)")


def _compare(name: str, peer: str, mine: dict, theirs: dict, runtime: bool = True) -> list[Check]:
    out = []
    rows = [
        ("cluster", "cluster_sha256", "cluster file", "copy the same cluster file to every node (NixOS: the same "
         "services.dspark.settings), then restart both"),
        ("model", "model_sha256", "model directory (config.json, index, shard names and sizes)",
         "the same download on every node: compare `ls -l` of model.path on both"),
        ("runtime", "vllm_sources_sha256", "vLLM sources (version and overlay)", "install the same runtime on every "
         "node (the same flake revision, or `dspark overlay apply` on both)"),
    ]
    for short, key, what, fix in (r for r in rows if runtime or r[0] != "runtime"):
        a, b = mine.get(key), theirs.get(key)
        label = f"{name}.{short}"
        if a is None or b is None:
            out.append(warn(label, f"{what} not known on {'this node' if a is None else peer}",
                            "see that node's own check"))
        elif a != b:
            extra = ""
            if short == "runtime":
                extra = f" (vLLM {mine.get('vllm_version')} here, {theirs.get('vllm_version')} on {peer})"
            out.append(fail(label, f"{peer} differs in {what}{extra}: {b[:12]} there, {a[:12]} here", fix))
        else:
            extra = f": vLLM {mine.get('vllm_version')}" if short == "runtime" else ""
            out.append(ok(label, f"same {what} as {peer}{extra} ({a[:12]})"))
    return out
