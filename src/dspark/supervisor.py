"""`dspark serve`: the one long-running process per node, the systemd unit's main process.

It runs vLLM as its child (in its own process group), follows its progress, decides when
the node is ready, keeps checking that it is alive, serves the node agent, speaks sd_notify,
and stops vLLM cleanly. Signal handlers only record the signal; the loop in `run` acts.

Ready:    worker: vLLM is up and waiting for (or in) the rendezvous;
          head:   /health answers 200 and a real 1-token completion succeeds.
Liveness: head: every `liveness_interval_s`, judged on progress while requests run or wait
          (vLLM's token counters must advance within `stall_s`), by a real 1-token completion
          while idle (vLLM's /health kept answering 200 after a worker died); see
          dspark.liveness. Every node: its peers' agents (a peer that restarted or vanished
          means the pair is broken, and a broken pair never heals: restarts are of the pair,
          worker first).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from . import agent as A
from . import hardware, vllm_facts
from .config import Cluster, NodeConfig
from .http import HTTPFailure, get_object, request
from .liveness import LivenessJudge, Verdict, read_progress
from .notify import Notifier, child_env
from .render import Launch, render

# Exit codes (the unit sets RestartPreventExitStatus=2: a bad config is not retried).
EXIT_OK = 0
EXIT_CONFIG = 2          # refused before starting anything: bad config, plan does not fit
EXIT_NEVER_READY = 3     # vLLM exited or timed out before the node became ready
EXIT_DIED = 4            # the node was serving (or in its pair) and then died or lost its pair

# Restart backoff. The units restart a failed node after a short fixed RestartSec= (systemd 252
# has no growing delay); the supervisor adds the growing part, from the failure history it
# keeps in the state directory, and says so in a STATUS= line.
BACKOFF_FIRST_S = 5.0
BACKOFF_MAX_S = 300.0
BACKOFF_STABLE_S = 120.0  # serving this long clears the history
FAILURES_FILE = "failures.json"

API_KEY_ENV = ("DSPARK_API_KEY", "VLLM_API_KEY")
API_KEY_CREDENTIAL = "api-key"  # systemd LoadCredential= name


def read_api_key(env: dict[str, str] | None = None) -> str | None:
    """The API key from systemd's credentials directory or the environment (never from the
    cluster file, which is world-readable and may live in the Nix store)."""
    env = os.environ if env is None else env
    cred_dir = env.get("CREDENTIALS_DIRECTORY")
    if cred_dir:
        path = Path(cred_dir) / API_KEY_CREDENTIAL
        if path.is_file():
            return path.read_text().strip() or None
    for key in API_KEY_ENV:
        if env.get(key):
            return env[key]
    return None


def resolve_gid_index(device: str, address: str, sysfs: Path = Path("/sys/class/infiniband")) -> str | None:
    """The GID index of `device` port 1 that carries `address` as a RoCE v2 IPv4 GID.

    The index can change after a reboot, so it is looked up at each launch (a stale shared
    NCCL_IB_GID_INDEX has wedged NCCL)."""
    import ipaddress

    port = sysfs / device / "ports" / "1"
    mapped = ipaddress.IPv6Address("::ffff:" + address).exploded  # IPv4-mapped GID form
    gids = port / "gids"
    if not gids.is_dir():
        return None
    for entry in sorted(gids.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1):
        try:
            gid = entry.read_text().strip()
            kind = (port / "gid_attrs" / "types" / entry.name).read_text().strip()
        except OSError:
            continue
        if gid.replace(":", "") == mapped.replace(":", "") and "v2" in kind.lower():
            return entry.name
    return None


def backoff_delay(failures: int) -> float:
    """Seconds to wait before starting after `failures` consecutive failed runs: the first retry
    at once (a pair re-forms after one death), then 5, 10, 20, ... up to BACKOFF_MAX_S."""
    if failures <= 1:
        return 0.0
    return min(BACKOFF_FIRST_S * 2 ** (failures - 2), BACKOFF_MAX_S)


class FailureHistory:
    """This node's consecutive failed runs, in the state directory across restarts.

    A run counts as failed from its start (a kill -9 or a watchdog abort leaves no chance to
    write anything) until it has served BACKOFF_STABLE_S or stops cleanly."""

    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / FAILURES_FILE

    def load(self) -> tuple[int, str]:
        import json

        try:
            d = json.loads(self.path.read_text())
            return max(0, int(d.get("consecutive", 0))), str(d.get("last", ""))
        except (OSError, ValueError, TypeError, AttributeError):
            return 0, ""

    def save(self, consecutive: int, last: str = "") -> None:
        import json

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps({"consecutive": consecutive, "last": last, "at": time.time()}) + "\n")
            tmp.replace(self.path)
        except OSError:
            pass


@dataclass
class Peer:
    node: NodeConfig
    started_at: float | None = None   # the peer's incarnation when the pair formed
    last_seen: float | None = None
    state: str | None = None


_VERSION_RE = re.compile(r"\(v(\d[^)\s]*)\)|version (\d+\.\d+\.\d+\S*)")


class Supervisor:
    def __init__(
        self,
        cluster: Cluster,
        node: NodeConfig,
        *,
        notifier: Notifier | None = None,
        env: dict[str, str] | None = None,
        state_dir: Path | None = None,
        launch: Launch | None = None,
        log: TextIO | None = None,
        api_key: str | None = None,
        tick_s: float = 0.1,
        backoff: bool = False,
    ):
        self.cluster = cluster
        self.node = node
        self.sup = cluster.supervisor
        self.notify = notifier if notifier is not None else Notifier()
        self.env = dict(os.environ if env is None else env)
        self.log = log or sys.stderr
        self.api_key = api_key
        self.tick_s = tick_s
        self.history = FailureHistory(state_dir) if backoff and state_dir is not None else None
        self._history_cleared = False
        self._failures = 0  # consecutive failed runs before this one
        if launch is None:
            gid = None
            if node.gid_index == "auto" and node.rdma_device:
                gid = resolve_gid_index(node.rdma_device, node.address)
                if gid is None:
                    self.say(f"no RoCE v2 GID for {node.address} on {node.rdma_device}; NCCL picks one")
            launch = render(cluster, node, gid)
        self.launch = launch
        self.state = A.NodeState(node=node.name, rank=node.rank, role="head" if node.is_head else "worker",
                                 restarts=_count_start(state_dir),
                                 api_url=cluster.head.api_url if node.is_head else None)
        self.peers = [Peer(n) for n in cluster.nodes if n.name != node.name
                      and (node.is_head or n.is_head)]
        self.proc: subprocess.Popen | None = None
        self.exit_signal: int | None = None
        self.ready = False
        self.paired = False           # all peers seen in the same pair
        self.committed = False        # head: vLLM started for the workers seen in the rendezvous
        self._stage = "starting"
        self._lock = threading.Lock()
        self._liveness_thread: threading.Thread | None = None
        self._verdict: tuple[Verdict, A.Liveness | None] | None = None
        self.judge = LivenessJudge(stall_s=self.sup.stall_s, probe_failures=self.sup.liveness_failures,
                                   fresh_s=self.sup.liveness_interval_s + self.sup.liveness_timeout_s)
        self.agent: A.Agent | None = None
        self._gpu = hardware.Gpu()

    # ------------------------------------------------------------------ small helpers
    def say(self, msg: str) -> None:
        print(f"dspark[{self.node.name}]: {msg}", file=self.log, flush=True)

    def set_state(self, state: str, detail: str = "") -> None:
        with self._lock:
            changed = state != self.state.state or detail != self.state.detail
            if state != self.state.state:
                self.state.state_since = time.time()
            self.state.state = state
            self.state.detail = detail
        if changed:
            text = f"{state}: {detail}" if detail else state
            self.notify.status(text)
            self.say(text)

    def snapshot(self) -> dict:
        with self._lock:
            snap = self.state.snapshot()
        # This node's GPU (NVML, where present) and NVMe readings, for the dashboard on the head.
        snap["hardware"] = hardware.read_local(self._gpu)
        return snap

    def handle_signal(self, signum, frame) -> None:  # only records; the loop acts
        self.exit_signal = signum

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self.handle_signal)

    # ------------------------------------------------------------------ vLLM process
    def start_vllm(self) -> None:
        env = child_env(self.env)
        env.update(self.launch.env)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.say("starting vLLM: " + " ".join(self.launch.argv))
        self.proc = subprocess.Popen(
            self.launch.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True, bufsize=1, text=True, errors="replace",
        )
        with self._lock:
            self.state.vllm_pid = self.proc.pid
        threading.Thread(target=self._pump, args=(self.proc.stdout,), name="vllm-log", daemon=True).start()

    def _pump(self, stream) -> None:
        """Copy vLLM's log to ours (the journal) and note the stage each line announces."""
        out = sys.stdout
        for line in stream:
            out.write(line)
            out.flush()
            for marker, stage in vllm_facts.LOG_STAGES:
                if marker in line and _later(stage, self._stage):
                    self._stage = stage
            if self.state.vllm_version is None and ("vLLM" in line or "version" in line):
                m = _VERSION_RE.search(line)
                if m:
                    with self._lock:
                        self.state.vllm_version = m.group(1) or m.group(2)

    def stop_vllm(self, reason: str) -> None:
        """SIGTERM vLLM's process group, then SIGKILL after the grace period."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            self.say(f"stopping vLLM (pid {proc.pid}): {reason}")
            # The unit is stopping: systemd pauses the watchdog and gives the stop its time.
            with self._lock:
                status = f"{self.state.state}: {self.state.detail}" if self.state.detail else self.state.state
            self.notify.send(stopping=1, status=status,
                             extend_timeout_usec=int((self.sup.stop_grace_s + 15) * 1e6))
            _signal_group(proc.pid, signal.SIGTERM)
            _signal_group(proc.pid, signal.SIGCONT)  # a stopped (hung) vLLM must see the SIGTERM
            deadline = time.monotonic() + self.sup.stop_grace_s
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if proc.poll() is None:
                self.say(f"vLLM did not exit within {self.sup.stop_grace_s:g} s; SIGKILL")
        # Children of a pair whose peer died can outlive the leader: always sweep the group.
        _signal_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        with self._lock:
            self.state.vllm_pid = None

    # ------------------------------------------------------------------ probes
    def api(self, path: str) -> str:
        return self.node.api_url.rstrip("/") + path

    def probe_health(self) -> bool:
        try:
            return request(self.api(vllm_facts.HEALTH), timeout=1.0, token=self.api_key).status == 200
        except HTTPFailure:
            return False

    def one_token(self, timeout: float) -> A.Liveness:
        """A real 1-token completion (a token-id prompt works with or without a tokenizer)."""
        body = {"model": self.cluster.model.served_name, "prompt": [0], "max_tokens": 1, "temperature": 0}
        t0 = time.time()
        try:
            r = request(self.api(vllm_facts.COMPLETIONS), data=body, timeout=timeout, token=self.api_key)
        except HTTPFailure as e:
            return A.Liveness(ok=False, at=t0, error=str(e))
        if r.status != 200:
            return A.Liveness(ok=False, at=t0, latency_s=r.elapsed_s, error=f"completion: HTTP {r.status}")
        try:
            ok = bool(r.json()["choices"])
        except (ValueError, KeyError, TypeError):
            ok = False
        return A.Liveness(ok=ok, at=t0, latency_s=r.elapsed_s, error=None if ok else "completion: bad answer")

    def _fetch_version(self) -> None:
        try:
            v = get_object(self.api(vllm_facts.VERSION), timeout=2.0, token=self.api_key).get("version")
        except (HTTPFailure, AttributeError):
            return
        with self._lock:
            self.state.vllm_version = v

    def read_progress(self):
        """vLLM's work counters from /metrics, or None when there is no usable answer."""
        try:
            r = request(self.api(vllm_facts.METRICS), timeout=self.sup.liveness_timeout_s, token=self.api_key)
            return read_progress(r.body.decode("utf-8", "replace")) if r.status == 200 else None
        except (HTTPFailure, ValueError):
            return None

    def _liveness_round(self) -> None:
        """One liveness round (in a thread): read the counters; probe only if the judge asks."""
        judge = self.judge
        before = self.read_progress()
        verdict = judge.observe(before, time.monotonic())
        probe = None
        if verdict.need_probe:
            probe = self.one_token(self.sup.liveness_timeout_s)
            # A second reading shows whether the engine worked meanwhile (and sets the baseline
            # past the probe's own tokens); pointless when /metrics gave nothing before.
            after = self.read_progress() if before is not None else None
            verdict = judge.probed(probe.ok, probe.error, probe.latency_s, after, time.monotonic())
        self._record_liveness(verdict, probe)

    def _record_liveness(self, verdict: Verdict, probe: A.Liveness | None) -> None:
        now_mono, now = time.monotonic(), time.time()
        proof = self.judge.proof
        live = A.Liveness(ok=verdict.alive, at=now, latency_s=probe.latency_s if probe else None,
                          error=verdict.reason or None)
        if proof is not None:
            live.proof, live.proof_at, live.proof_detail = proof.kind, now - (now_mono - proof.at), proof.detail
        with self._lock:
            self.state.liveness = live
            self._verdict = (verdict, probe)

    def check_peers(self, now: float) -> str | None:
        """Poll the peers' agents; return why the pair is broken, or None."""
        # A head that started vLLM for the workers in the rendezvous is bound to those
        # incarnations: one that restarts or vanishes would leave its vLLM waiting forever.
        bound = self.paired or self.committed
        for p in self.peers:
            refused = False
            try:
                s = get_object(p.node.agent_url + "/state", timeout=1.0)
            except HTTPFailure as e:
                s, refused = None, e.refused
            if s is not None:
                p.last_seen, p.state = now, s.get("state")
                if p.started_at is None and bound:
                    p.started_at = s.get("started_at")
                if bound and p.started_at is not None and s.get("started_at") != p.started_at:
                    return f"{p.node.name} restarted; the pair must re-form"
                if bound and p.state in (A.FAILED, A.STOPPING, A.STOPPED):
                    return f"{p.node.name} is {p.state}"
            elif bound and refused and p.last_seen is not None:
                # Nothing listens where its agent was: its supervisor has exited.
                return f"{p.node.name}'s supervisor is gone (agent refused the connection)"
            elif bound and p.last_seen is not None and now - p.last_seen > self.sup.head_lost_s:
                return f"{p.node.name}'s agent unreachable for {now - p.last_seen:.0f} s"
            elif bound and p.last_seen is None:
                p.last_seen = now  # start the clock at pair formation
        return None

    def _watchdog_ok(self, now: float) -> bool:
        if self.node.is_head:
            # Only while a liveness round found the engine alive recently (progress or probe).
            return self.judge.fed(now)
        return self.proc is not None and self.proc.poll() is None

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        self.set_state(A.STARTING, f"rank {self.node.rank} of {len(self.cluster.nodes)}")
        self.agent = A.Agent(self.node.agent_bind, self.node.agent_port, self.snapshot).start()
        try:
            code = self._backoff() if self.history is not None else None
            if code is None:
                code = self._run()
            if self.history is not None:
                if code == EXIT_OK:
                    self.history.save(0)
                else:
                    self.history.save(self._failures + 1, f"exit {code}: {self.state.detail}")
            return code
        finally:
            if self.proc is not None:
                self.stop_vllm("supervisor exiting")
            self.agent.stop()
            self.notify.close()

    def _backoff(self) -> int | None:
        """Wait out the delay the failure history calls for; EXIT_OK if stopped meanwhile."""
        self._failures, last = self.history.load()
        self.history.save(self._failures + 1, "did not finish: killed, crashed or watchdog timeout")
        delay = backoff_delay(self._failures)
        if delay <= 0:
            return None
        self.notify.extend_timeout(delay + 60)
        self.set_state(A.STARTING, f"backoff: {self._failures} failed runs in a row (last: {last}); "
                                   f"starting in {delay:.0f} s")
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline:
            if self.exit_signal is not None:
                self.set_state(A.STOPPED, "stopped during the restart backoff")
                return EXIT_OK
            time.sleep(self.tick_s)
        return None

    def _run(self) -> int:
        t_start = time.monotonic()
        if self.node.is_head and self.peers:
            code = self._wait_for_workers(t_start)
            if code is not None:
                return code
            self.committed = True
        self.start_vllm()
        last_extend = last_health = last_live = last_peers = last_dog = 0.0
        while True:
            now = time.monotonic()
            if self.exit_signal is not None:
                name = signal.Signals(self.exit_signal).name
                self.notify.stopping(f"stopping ({name})")
                self.set_state(A.STOPPING, f"received {name}")
                self.stop_vllm(name)
                self.set_state(A.STOPPED, f"vLLM stopped after {name}")
                return EXIT_OK
            rc = self.proc.poll()
            if rc is not None:
                when = "while serving" if self.ready else "before becoming ready"
                self.set_state(A.FAILED, f"vLLM exited with code {rc} {when}")
                return EXIT_DIED if self.ready else EXIT_NEVER_READY

            if not self.paired and _at_least(self._stage, "loading"):
                self.paired = True  # the rendezvous completed: from now on, peers must stay
            if not self.ready:
                if now - t_start > self.sup.ready_timeout_s:
                    self.set_state(A.FAILED, f"not ready after {self.sup.ready_timeout_s:g} s (ready_timeout_s)")
                    self.stop_vllm("never became ready")
                    return EXIT_NEVER_READY
                if now - last_extend > 30:
                    # Keep systemd's start timeout ahead of a long model load.
                    self.notify.extend_timeout(90)
                    last_extend = now
                stage = self._stage
                if self.node.is_head:
                    if stage != self.state.state and stage != "starting":
                        self.set_state(stage, _stage_detail(stage))
                    if now - last_health >= 0.1:  # READY within a tick of vLLM answering
                        last_health = now
                        if self.probe_health():
                            live = self.one_token(self.sup.liveness_timeout_s)
                            if live.ok:
                                self._record_liveness(self.judge.probed(True, None, live.latency_s,
                                                                        self.read_progress(), now), live)
                                self._fetch_version()
                                self._become_ready(now)
                                last_live = now
                            else:
                                with self._lock:
                                    self.state.liveness = live
                else:
                    if stage != "starting" and stage != self.state.state:
                        self.set_state(stage, _stage_detail(stage))
                    if stage != "starting":
                        # Up and waiting for (or in) the rendezvous: the worker is ready.
                        self.ready = True
                        self.notify.ready(f"{stage}: {_stage_detail(stage)}")
                        self.say("ready (in the rendezvous)")
            else:
                if self.node.is_head:
                    live_thread = self._liveness_thread
                    if live_thread is not None and not live_thread.is_alive():
                        self._liveness_thread = None
                        verdict, probe = self._verdict
                        if not verdict.alive:
                            self.say(verdict.reason)
                        if verdict.dead:
                            hung = probe is not None and probe.latency_s is None
                            if self.notify.watchdog_interval and hung:
                                # No answer at all: a hung vLLM. Under systemd's watchdog that
                                # is its call (the pings stopped with the last round that found
                                # it alive; it kills what no longer responds, result 'watchdog').
                                # An error answer or a stall is ours to act on, below.
                                self.set_state(A.FAILED, f"liveness lost: {verdict.reason}; "
                                                         "the watchdog restarts the node")
                            else:
                                self.set_state(A.FAILED, f"liveness lost: {verdict.reason}")
                                self.stop_vllm("liveness lost")
                                return EXIT_DIED
                    if self._liveness_thread is None and now - last_live >= self.sup.liveness_interval_s:
                        last_live = now
                        self._liveness_thread = threading.Thread(target=self._liveness_round, daemon=True)
                        self._liveness_thread.start()
                else:
                    stage = self._stage
                    if self.state.state not in (A.SERVING,) and stage != self.state.state:
                        self.set_state(stage, _stage_detail(stage))

            if self.peers and now - last_peers >= 1.0:
                last_peers = now
                if not self.node.is_head:
                    self._follow_head()
                broken = self.check_peers(time.time())
                if broken:
                    self.set_state(A.FAILED, f"pair broken: {broken}")
                    self.stop_vllm("pair broken")
                    return EXIT_DIED if (self.ready or self.paired) else EXIT_NEVER_READY
                if not self.node.is_head and not self.paired and now - t_start > self.sup.rendezvous_timeout_s:
                    self.set_state(A.FAILED, f"no head joined within {self.sup.rendezvous_timeout_s:g} s")
                    self.stop_vllm("rendezvous timed out")
                    return EXIT_NEVER_READY

            if (self.history is not None and not self._history_cleared and self.state.state == A.SERVING
                    and time.time() - self.state.state_since >= BACKOFF_STABLE_S):
                self.history.save(0)  # served long enough: the next failure restarts at once
                self._history_cleared = True
                self._failures = 0

            wd = self.notify.watchdog_interval
            if self.ready and wd and now - last_dog >= wd and self._watchdog_ok(now):
                self.notify.watchdog()
                last_dog = now
            time.sleep(self.tick_s)

    def _become_ready(self, now: float) -> None:
        self.ready = True
        self.paired = True
        self.set_state(A.SERVING, f"API on {self.node.api_url}")
        self.notify.ready(f"serving: API on {self.node.api_url}")

    def _follow_head(self) -> None:
        """A worker is serving while its head is; the pair forms when the head serves."""
        head = next(p for p in self.peers if p.node.is_head)
        if head.state == A.SERVING and self.ready and self.state.state != A.SERVING:
            self.paired = True
            self.set_state(A.SERVING, f"pair serving with {head.node.name}")

    def _wait_for_workers(self, t_start: float) -> int | None:
        """The head starts vLLM only once every worker's agent reports the rendezvous."""
        from .status import wait_for_workers

        self.set_state(A.RENDEZVOUS, "waiting for the worker(s) to enter the rendezvous")
        last_extend = 0.0

        def keep_going(waiting: list[str]) -> bool:
            nonlocal last_extend
            now = time.monotonic()
            if now - last_extend > 30:
                self.notify.extend_timeout(90)
                last_extend = now
            detail = "waiting for " + ", ".join(waiting) + " to enter the rendezvous"
            if detail != self.state.detail:
                self.set_state(A.RENDEZVOUS, detail)
            return self.exit_signal is None

        # Polled briskly: every moment here is added to the pair's start.
        ok, why = wait_for_workers(self.cluster, self.sup.worker_wait_timeout_s, keep_going,
                                   states=(A.RENDEZVOUS,), poll_s=0.1)
        if self.exit_signal is not None:
            self.set_state(A.STOPPED, "stopped while waiting for the worker(s)")
            return EXIT_OK
        if not ok:
            self.set_state(A.FAILED, why)
            return EXIT_NEVER_READY
        return None


def _at_least(stage: str, floor: str) -> bool:
    order = vllm_facts.STAGE_ORDER
    return stage in order and order.index(stage) >= order.index(floor)


def _later(stage: str, current: str) -> bool:
    order = vllm_facts.STAGE_ORDER
    return order.index(stage) > order.index(current) if current in order else False


def _stage_detail(stage: str) -> str:
    return {
        "rendezvous": "vLLM is in the rendezvous",
        "loading": "loading the model",
        "warming": "warming up (profiling, compiling, capturing graphs)",
    }.get(stage, "")


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _count_start(state_dir: Path | None) -> int:
    """Restarts of this node's service: starts recorded in the state directory, minus one."""
    if state_dir is None:
        return 0
    path = Path(state_dir) / "starts"
    try:
        starts = int(path.read_text().strip()) if path.exists() else 0
    except (OSError, ValueError):
        starts = 0
    try:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        path.write_text(f"{starts + 1}\n")
    except OSError:
        pass
    return starts


def serve(cluster: Cluster, node: NodeConfig, *, state_dir: Path | None = None) -> int:
    """The body of `dspark serve` (the CLI checks the memory plan first): supervise until
    stopped. Returns the exit code."""
    # The restart backoff only matters where something restarts the node: under systemd.
    sup = Supervisor(cluster, node, state_dir=state_dir, api_key=read_api_key(),
                     backoff="INVOCATION_ID" in os.environ)
    sup.install_signal_handlers()
    return sup.run()
