"""The local appliance: the GB10 pair (or ring of N nodes) on one machine, with the real vLLM
CPU build, brought up (`up`) and supervised (`Pair`: its processes and their logs).

The cluster file dspark.local.cluster generates (head on 127.0.0.1, rank r on 127.0.0.(r+1),
tensor parallel over all of them) and a tiny random-weight model, run through the very same
`dspark serve` supervisors as on the GB10 nodes: the workers first, then the head once every
worker's agent reports the rendezvous. dspark.local.lock holds the directory and checks the
ports; dspark.local.stop is `local down`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dspark.config import validate as C
from dspark.config.schema import Cluster, NodeConfig
from dspark.lines import state as line_state
from dspark.local import vision as local_vision
from dspark.local.cluster import (
    DEFAULT_NODES,
    HEAD_NAME,
    SERVED_NAME,
    LocalError,
    LocalPorts,
    Progress,
    check_nodes,
    check_vision,
    prepare,
    vllm_command,
)
from dspark.local.lock import check_ports_free, take_dir
from dspark.local.stop import STOP_GRACE_S, STOP_MARGIN_S, planned_stop_s
from dspark.node import states as A
from dspark.node.agent_client import agent_state
from dspark.node.notify import NOTIFY_ENV
from dspark.node.signals import SignalQueue
from dspark.node.vllm_process import end_group
from dspark.status import cli_command

if TYPE_CHECKING:
    from dspark.preflight import Host


@dataclass
class Pair:
    """The supervisors of a running local appliance, by node name (the head's first)."""

    cluster_file: Path
    workdir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    seen: dict[str, str] = field(default_factory=dict)  # the last state shown of each node

    def spawn(self, node: str) -> subprocess.Popen:
        logs = self.workdir / "logs"
        logs.mkdir(exist_ok=True)
        log = logs / f"{node}.log"
        if node not in self.procs and log.exists():
            log.replace(logs / f"{node}.log.1")  # each run starts a fresh log; the last run's is kept
        out = open(log, "ab")
        cmd = [sys.executable, "-m", "dspark", "serve", "--config", str(self.cluster_file), "--node", node,
               "--state-dir", str(self.workdir / "state" / node)]
        env = {k: v for k, v in os.environ.items() if k not in NOTIFY_ENV}
        # Own session: a Ctrl-C in the terminal reaches `local up`, which stops the pair in order.
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env=env)
        out.close()
        self.procs[node] = p
        return p

    def stop(self, bound_s: float = STOP_GRACE_S, *, planned: bool = False,
             again: Callable[[], bool] = lambda: False) -> str:
        """Stop every supervisor within `bound_s`. Planned: SIGTERM to the head alone, which drains
        the requests in flight (they need the workers' ranks) and stops; its workers stop on their
        own once it shows STOPPED. Otherwise (after a fault) SIGTERM to every one at once. Those
        still running STOP_MARGIN_S / 2 before the bound get SIGTERM, those still running at the
        bound SIGKILL. `again()` true (a second Ctrl-C): SIGKILL at once. Returns what it had to
        do beyond the plan ("" for nothing)."""
        deadline = time.monotonic() + bound_s
        head = self.procs.get(HEAD_NAME)
        if planned and head is not None and head.poll() is None:
            head.send_signal(signal.SIGTERM)
            done = self._wait_all(deadline - STOP_MARGIN_S / 2, again)
        else:
            done = False
        forced = ""
        if not done and not again():
            for p in self.procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            done = self._wait_all(deadline, again)
        if again():
            forced = "a second signal: every node killed at once (SIGKILL)"
        elif not done:
            forced = f"still running {bound_s:g} s after the stop began: killed (SIGKILL)"
        for p in self.procs.values():
            # A supervisor sweeps vLLM's process group itself (its reaper does, should the
            # supervisor be killed); this sweeps the supervisor's own group, the last resort.
            end_group(p.pid, [p])
        return forced

    def _wait_all(self, until: float, again: Callable[[], bool]) -> bool:
        """Wait until every supervisor has exited (True), `until` passes or `again()` (False)."""
        while time.monotonic() < until and not again():
            if all(p.poll() is not None for p in self.procs.values()):
                return True
            time.sleep(0.1)
        return all(p.poll() is not None for p in self.procs.values())



def wait_state(pair: Pair, node: NodeConfig, states: tuple[str, ...], timeout_s: float,
               progress: Progress, should_stop: Callable[[], bool], t0: float | None = None,
               watch: tuple[NodeConfig, ...] = ()) -> None:
    """Wait until `node` is in one of `states`. Every state change of it and of the `watch`
    nodes is shown once, in the order seen, with the seconds since `t0` (local up's start)."""
    since = time.monotonic()
    t0 = since if t0 is None else t0
    while True:
        for n in (node, *watch):
            p = pair.procs[n.name]
            rc = p.poll()
            if rc is not None:
                raise LocalError(f"{n.name}'s supervisor exited with code {rc}; see "
                                 f"{pair.workdir / 'logs' / (n.name + '.log')}")
            s = agent_state(n.agent_url, timeout=1.0)
            cur = (s or {}).get("state", "starting")
            detail = (s or {}).get("detail") or f"supervisor started (pid {p.pid}); its agent is not answering yet"
            if pair.seen.get(n.name) != cur:
                progress(f"  {n.name:<13} {cur:<11} {detail}  [{time.monotonic() - t0:5.1f} s]")
                pair.seen[n.name] = cur
            if cur == A.FAILED:
                raise LocalError(f"{n.name} failed: {detail}")
        if pair.seen.get(node.name) in states:
            return
        if should_stop():
            raise KeyboardInterrupt
        if time.monotonic() - since > timeout_s:
            raise LocalError(f"{node.name} not {'/'.join(states)} after {timeout_s:g} s")
        time.sleep(0.5)


def preflight(cluster: Cluster, node: NodeConfig, progress: Progress, host: Host | None = None) -> None:
    """`dspark check` for `node` before it starts: warnings and failures shown, a failure stops."""
    import dataclasses

    from dspark.preflight import Host, run

    report = run(cluster, node, dataclasses.replace(host or Host(), starting=True))
    for c in report.checks:
        if c.status != "ok":
            progress(f"  {node.name:<13} check {c.status}: {c.name}: {c.seen}")
    if report.failed:
        raise LocalError("dspark check failed for " + node.name + ": "
                         + "; ".join(f"{c.name}: {c.seen} (fix: {c.fix})" for c in report.failed))
    progress(f"  {report.summary()}")


def up(workdir: Path, ports: LocalPorts = LocalPorts(), progress: Progress = print,
       compile: bool = False, on_ready: Callable[[Pair], None] | None = None, check_host: Host | None = None,
       nodes: int = DEFAULT_NODES, line: str | None = None, vision: bool = False) -> int:
    """Bring the appliance up, report, and supervise until Ctrl-C / SIGTERM; always stop every
    node. Each node is checked (`dspark check`) right before it starts; `check_host`: where the
    checks look (dspark.preflight.Host; default this machine). `line`: the runtime line every
    node runs (default: the default line, this environment's vLLM). `vision`: serve the tiny
    vision model (dspark.local.vision) in place of the text one."""
    check_nodes(nodes)  # before the ports: a count the model cannot take is the first thing to say
    vllm_command(line)  # a line that is not installed: said before the ports are looked at
    if vision:
        check_vision(line, nodes)
    # The directory before the ports: another appliance there is named by its PID, and nothing
    # in the directory is touched (cluster file, logs, state) while another appliance holds it.
    lock = take_dir(workdir, progress)
    try:
        return _up(workdir, ports, progress, compile, on_ready, check_host, nodes, line, vision)
    finally:
        lock.release()


def _up(workdir: Path, ports: LocalPorts, progress: Progress, compile: bool,
        on_ready: Callable[[Pair], None] | None, check_host: Host | None, nodes: int, line: str | None,
        vision: bool) -> int:
    """up()'s body, with `workdir` held (`lock`)."""
    check_ports_free(ports, nodes)
    cluster_file = prepare(workdir, ports, compile, nodes, line, vision)
    cluster = C.load(cluster_file)
    head, workers = cluster.head, cluster.workers
    pair = Pair(cluster_file, workdir.resolve())
    # A fresh appliance: no restart count or failure history carried over from earlier runs.
    for node in cluster.nodes:
        for name in ("starts", "failures.json", line_state.FILE):
            (pair.workdir / "state" / node.name / name).unlink(missing_ok=True)
    sigs = SignalQueue().install((signal.SIGINT, signal.SIGTERM))

    def stopping() -> bool:
        return sigs.first is not None

    everyone = "both nodes" if nodes == 2 else f"all {nodes} nodes"
    sup = cluster.supervisor
    bound = planned_stop_s(sup)
    drain = (f"the head first: its requests in flight have up to {sup.drain_s:g} s, vLLM {sup.stop_grace_s:g} s "
             f"more to exit; done within {bound:g} s; Ctrl-C again kills every node at once"
             if sup.drain_s > 0 else f"the head first; done within {bound:g} s; Ctrl-C again kills every node at once")
    planned = False
    t0 = time.monotonic()
    try:
        progress(f"dspark local: cluster {cluster_file}; [times] are seconds since local up started")
        progress(f"runtime line {cluster.serving.runtime_line}: {' '.join(cluster.serving.vllm_command)}")
        for w in workers:
            progress(f"checking {w.name} (rank {w.rank}, {w.address})")
            preflight(cluster, w, progress, check_host)
            progress(f"starting {w.name} (rank {w.rank}, {w.address}); logs in {pair.workdir / 'logs'}")
            pair.spawn(w.name)
        for w in workers:
            others = tuple(o for o in workers if o is not w)
            wait_state(pair, w, (A.RENDEZVOUS, A.SERVING), 600, progress, stopping, t0, watch=others)
        # The head is checked once the workers run: its check compares the nodes' cluster
        # file, model, runtime and clocks through the workers' agents.
        preflight(cluster, head, progress, check_host)
        progress(f"starting the head (rank 0, {head.address})")
        pair.spawn(head.name)
        wait_state(pair, head, (A.SERVING,), cluster.supervisor.ready_timeout_s, progress, stopping, t0,
                   watch=tuple(workers))
        # The workers follow their head into serving within a poll (about a second).
        for w in workers:
            wait_state(pair, w, (A.SERVING,), 30, progress, stopping, t0,
                       watch=(head, *(o for o in workers if o is not w)))
        elapsed = time.monotonic() - t0
        progress("")
        progress(f"serving after {elapsed:.0f} s: {head.api_url}/v1  (model {SERVED_NAME!r}; random weights, "
                 "so its text is gibberish)")
        progress(f"  curl -s {head.api_url}/v1/chat/completions -H 'Content-Type: application/json' \\")
        progress(f"    -d '{{\"model\": \"{SERVED_NAME}\", \"messages\": [{{\"role\": \"user\", \"content\": "
                 f"\"Hello\"}}], \"max_tokens\": 16}}'")
        progress("  (text, chat and token-id prompts all work: the tiny model has a tokenizer and a chat template; "
                 "docs/quick-start.md has the same request with the OpenAI SDK)")
        if vision:
            progress(f"  (vision: a user message may carry one image, an image_url part with a data URL; "
                     f"it takes {local_vision.IMAGE_TOKENS} prompt tokens, whatever its size)")
        progress(f"  {cli_command()} status --config {cluster_file}")
        progress(f"Ctrl-C stops {everyone}.")
        if on_ready:
            on_ready(pair)
        while sigs.first is None:
            for name, p in pair.procs.items():
                if p.poll() is not None:
                    raise LocalError(f"{name}'s supervisor exited with code {p.returncode}; see "
                                     f"{pair.workdir / 'logs' / (name + '.log')}")
            sigs.get(0.5)
        progress(f"stopping {everyone} ({drain}) ...")
        planned = True
        return 0
    except KeyboardInterrupt:
        progress(f"stopping {everyone} ({drain}) ...")
        planned = True
        return 130
    finally:
        # A planned stop: the head first, which drains (drain_s), then vLLM has stop_grace_s and
        # its sweep; the workers stop once it shows STOPPED. After a fault (a supervisor exited:
        # the pair is broken) every node at once. A second Ctrl-C kills them all at once.
        t_stop = time.monotonic()
        forced = pair.stop(bound if planned else STOP_GRACE_S, planned=planned, again=lambda: sigs.received >= 2)
        sigs.restore()
        if forced:
            progress(forced)
        progress(f"stopped; no process left behind (the stop took {time.monotonic() - t_stop:.1f} s)"
                 if all(p.poll() is not None for p in pair.procs.values()) else "warning: a supervisor did not exit")
