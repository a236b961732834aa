"""The local appliance (worker 127.0.0.2 + head 127.0.0.1, real vLLM CPU build; or a ring of N
nodes, rank r on 127.0.0.(r+1)) installed with the project's own units in a `Container`, as
`dspark systemd install` sets it up on a host that runs every node. Shared by tests/systemd and
benchmarks/failover.py.

`use_standin` puts the stand-in vLLM (tests/harness/standin_vllm.py: vLLM's CLI shape, log lines, HTTP
API and /metrics, up in about a second) in place of vLLM under the very same units: the cluster
file's serving.vllm_command names a copy of it inside the container, run by the runtime's
interpreter, both executable by user dspark under the units' sandbox. `record_real_start_ups`
counts, from the head unit's journal, the real vLLM start-ups of a container (tests.harness.pair)."""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from dspark.local.cluster import (
    DEFAULT_NODES,
    HEAD_NAME,
    LINES_DIR_ENV,
    SERVED_NAME,
    LocalPorts,
    node_address,
    node_name,
)
from dspark.units.dropins import NodeRole, node_units
from tests.harness.nspawn_container import ROOT, Container
from tests.harness.pair import count_head_starts, pick_ports, record_start_ups  # shared with the pair tests

CLUSTER_DIR = "/srv/dspark-local"  # inside the container (outside /tmp: PrivateTmp hides that)
PYTHON = str(ROOT / ".venv" / "bin" / "python")
DSPARK = str(ROOT / ".venv" / "bin" / "dspark")
# Inside the container, when user dspark cannot execute the checkout's interpreter (a pyenv
# under /root, mode 700): a venv on a Python it can execute, reading the checkout venv's
# packages. What the units run lives here, so they run exactly as shipped (User=dspark).
RUNTIME = "/opt/dspark/venv"
# Every other runtime line installed in the checkout (.ci/setup: .venv-lines/<line>/), made
# executable the same way, one folder per line: install(lines=True) names it DSPARK_LINES_DIR for
# prepare(), so the cluster file's serving.line_commands run LINES/<line>/bin/vllm.
LINES = "/opt/dspark/lines"
CHECKOUT_LINES = ROOT / ".venv-lines"
# The stand-in vLLM inside the container (use_standin): a copy of tests/harness/standin_vllm.py, mode 0644
# under 0755 folders, so user dspark reads it wherever the checkout lives (a CI clone under /root,
# mode 700, would not do); the runtime's interpreter (runtime()) runs it.
STANDIN_SOURCE = ROOT / "tests" / "harness" / "standin_vllm.py"
STANDIN = "/opt/dspark/standin/vllm.py"
UNITS = ("dspark-head.service", "dspark-worker.service", "dspark-wait-worker.service",
         "dspark-worker-ready.target")  # the pair's (Appliance.units: any number of nodes)


@dataclass
class Appliance:
    box: Container
    ports: LocalPorts
    user_note: str = ""  # which runtime the units (as user dspark) run from
    nodes: int = DEFAULT_NODES
    dspark: str = DSPARK  # the dspark CLI the units run (root may run it too: dspark switch)
    lines: dict[str, str] | None = None  # install(lines=True): each other line's folder under LINES
    python: str = PYTHON  # the runtime's interpreter the units' user executes (runtime())
    standin: bool = False  # use_standin(): the stand-in vLLM runs in place of vLLM

    @property
    def names(self) -> list[str]:
        """The nodes' names in rank order (the head's first)."""
        return [node_name(r) for r in range(self.nodes)]

    @property
    def workers(self) -> list[str]:
        return self.names[1:]

    def unit(self, node: str) -> str:
        """The unit that runs `node` (dspark-worker.service for the pair's one worker,
        dspark-worker@NODE.service for each of several)."""
        return node_units([NodeRole(n, n == HEAD_NAME) for n in self.names])[node]

    @property
    def units(self) -> list[str]:
        """Every unit of the appliance: the nodes' (head first) and the head's helpers."""
        return [self.unit(n) for n in self.names] + ["dspark-wait-worker.service", "dspark-worker-ready.target"]

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.api}"

    @property
    def cluster(self):
        """The cluster file the units run with (read through the container's root)."""
        from dspark.config import validate as C

        return C.load(self.box.path(f"{CLUSTER_DIR}/cluster.toml"))

    def agent_url(self, node: str) -> str:
        return f"http://{node_address(self.names.index(node))}:{self.ports.agent}"

    def state(self, node: str, timeout: float = 2.0) -> dict | None:
        try:
            with urllib.request.urlopen(self.agent_url(node) + "/state", timeout=timeout) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def complete(self, max_tokens: int = 1, timeout: float = 30.0) -> tuple[int | None, str]:
        """(HTTP status or None for no answer, detail) of a real completion on the head's API."""
        body = json.dumps({"model": SERVED_NAME, "prompt": [1, 2, 3], "max_tokens": max_tokens,
                           "temperature": 0}).encode()
        req = urllib.request.Request(self.api_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode(errors="replace")[:200]
        except urllib.error.HTTPError as e:
            return e.code, str(e)
        except (OSError, ValueError) as e:
            return None, str(e)

    def serving(self) -> bool:
        states = [self.state(n) for n in self.names]
        return bool(all(s and s["state"] == "serving" for s in states) and self.complete(timeout=10)[0] == 200)

    def wait_serving(self, timeout: float) -> float:
        """Seconds until every node serves and a completion succeeds; raises on timeout."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.serving():
                return time.monotonic() - t0
            time.sleep(0.5)
        raise TimeoutError(f"{'pair' if self.nodes == 2 else 'ring'} not serving after {timeout:.0f} s:\n"
                           + self.diagnose())

    def diagnose(self) -> str:
        return "\n".join(self.box.status(u) for u in self.units)

    def kill(self, signal: str, pid: int, group: bool = False) -> None:
        target = f"-{pid}" if group else str(pid)
        self.box.run("kill", f"-{signal}", "--", target, timeout=10, check=True)

    def kill_vllm_until_the_head_leaves(self, node: str, within: float = 60.0) -> float | None:
        """SIGKILL `node`'s vLLM; seconds until the head's agent stops reporting `serving`
        (None: still serving after `within`)."""
        pid = self.state(node)["vllm_pid"]  # in the container's PID namespace
        t0 = time.monotonic()
        self.kill("KILL", pid)
        while time.monotonic() - t0 < within:
            s = self.state(HEAD_NAME, timeout=1.0)
            if s is None or s["state"] != "serving":
                return time.monotonic() - t0
            time.sleep(0.2)
        return None

    def drop_local_ordering(self) -> None:
        """The cross-host shape on one host: the drop-ins' ordering between the head and its
        workers goes (wait-worker's, and the head's Wants=/After=), only the ordering; the shared
        /tmp stays (one host: vLLM's IPC sockets live there). Run with the nodes stopped."""
        self.box.path("/etc/systemd/system/dspark-wait-worker.service.d/60-dspark-local-pair.conf").unlink()
        head_dropin = self.box.path("/etc/systemd/system/dspark-head.service.d/60-dspark-local-pair.conf")
        head_dropin.write_text("\n".join(line for line in head_dropin.read_text().splitlines()
                                         if not line.startswith(("Wants=", "After="))) + "\n")
        self.box.systemctl("daemon-reload", check=True)

    def main_pid_restarts(self, unit: str) -> int:
        return int(self.box.show(unit, "NRestarts")["NRestarts"])


def _dspark_can_execute(box: Container, python: str, module: str = "dspark") -> bool:
    probe = box.run("setpriv", "--reuid=dspark", "--regid=dspark", "--clear-groups", "--inh-caps=-all",
                    "sh", "-c", f'exec "$0" -c "import {module}"', python, timeout=120)
    return probe.returncode == 0


def runtime(box: Container) -> tuple[str, str, str]:
    """(python, dspark, how) that the service user can execute inside the container: the
    checkout's venv when it can, else a venv under RUNTIME on this Python version's system
    interpreter whose site-packages are the checkout venv's (a .pth file), scripts included."""
    box.run("systemd-sysusers", timeout=60)  # the dspark user (the units' sysusers.d file comes later)
    box.run("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "dspark", timeout=30)
    if _dspark_can_execute(box, PYTHON):
        return PYTHON, DSPARK, "the checkout's venv"
    base = _system_python()
    _venv_over(box, base, RUNTIME, ROOT / ".venv", ("dspark", "vllm"))
    if not _dspark_can_execute(box, f"{RUNTIME}/bin/python"):
        raise RuntimeError(f"user dspark cannot execute {RUNTIME}/bin/python either")
    return f"{RUNTIME}/bin/python", f"{RUNTIME}/bin/dspark", f"{RUNTIME} on {base}"


def _system_python() -> str:
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    base = next((c for c in (f"/usr/bin/{ver}", f"/usr/local/bin/{ver}") if os.access(c, os.X_OK)), None)
    if base is None:
        raise RuntimeError(f"user dspark cannot execute {os.path.realpath(PYTHON)} and there is no "
                           f"system {ver} to build {RUNTIME} on")
    return base


def _venv_over(box: Container, base: str, dest: str, source: Path, scripts: tuple[str, ...]) -> None:
    """A venv at `dest` (inside the container) on `base` whose site-packages are the venv
    `source`'s (a .pth file), with `source`'s `scripts` pointed at its own interpreter."""
    box.run(base, "-m", "venv", "--without-pip", dest, timeout=120, check=True)
    inside_site = box.run(f"{dest}/bin/python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))",
                          timeout=60, check=True).stdout.strip()
    source_site = sysconfig.get_path("purelib", vars={"base": str(source), "platbase": str(source)})
    box.path(inside_site).joinpath("dspark-checkout.pth").write_text(
        f"import site; site.addsitedir({source_site!r})\n")
    for script in scripts:
        src = source / "bin" / script
        if src.exists():
            lines = src.read_text().splitlines(keepends=True)
            dst = box.path(f"{dest}/bin/{script}")
            dst.write_text(f"#!{dest}/bin/python\n" + "".join(lines[1:]))
            dst.chmod(0o755)


def line_runtimes(box: Container) -> dict[str, str]:
    """{line: its folder under LINES} for every other runtime line installed in the checkout
    (CHECKOUT_LINES/<line>/bin/vllm), each with a bin/vllm the service user can execute: the
    checkout's own (a symlink) when that user can run its interpreter, else a venv on the
    system Python reading the line's site-packages (as runtime() does for the default line).
    The folders are the container's own: a test may put a wrapper in place of a bin/vllm."""
    out: dict[str, str] = {}
    for venv in sorted(CHECKOUT_LINES.glob("*/bin/vllm")):
        line_dir = venv.parents[1]
        dest = f"{LINES}/{line_dir.name}"
        if _dspark_can_execute(box, str(line_dir / "bin" / "python"), module="vllm"):
            box.path(f"{dest}/bin").mkdir(parents=True)
            box.path(f"{dest}/bin/vllm").symlink_to(venv)
        else:
            _venv_over(box, _system_python(), dest, line_dir, ("vllm",))
            if not _dspark_can_execute(box, f"{dest}/bin/python", module="vllm"):
                raise RuntimeError(f"user dspark cannot execute {dest}/bin/python (runtime line {line_dir.name})")
        out[line_dir.name] = dest
    return out


def install(box: Container, ports: LocalPorts | None = None, nodes: int = DEFAULT_NODES,
            lines: bool = False) -> Appliance:
    """Write the local cluster of `nodes` nodes into the container and install the units for
    every one of them, as shipped: they run as the dspark user, from where that user can
    execute them. `lines`: every runtime line installed in the checkout is installed too
    (line_runtimes) and named in the cluster file's serving.line_commands (dspark switch)."""
    ports = ports or pick_ports(nodes)  # the container shares the host's network namespace
    python, dspark, how = runtime(box)
    line_dirs = line_runtimes(box) if lines else None
    # prepare() names vLLM's CLI beside the Python that runs it: the runtime's; each other
    # line's under DSPARK_LINES_DIR (without `lines`, as the caller's environment has it).
    env = {**os.environ, LINES_DIR_ENV: LINES} if lines else None
    box.run(python, "-c", "import sys; from pathlib import Path; "
            "from dspark.local.cluster import prepare, LocalPorts; "
            f"prepare(Path({CLUSTER_DIR!r}), LocalPorts(api={ports.api}, master={ports.master}, "
            f"agent={ports.agent}), nodes={nodes})", timeout=60, check=True, env=env)
    app = Appliance(box, ports, user_note=f"units run as user dspark from {how}", nodes=nodes, dspark=dspark,
                    lines=line_dirs, python=python)
    box.run(dspark, "systemd", "install", *(a for n in app.names for a in ("--node", n)),
            "--config", f"{CLUSTER_DIR}/cluster.toml", "--dspark-bin", dspark, timeout=60, check=True)
    bind_checkout(box, [app.unit(n) for n in app.names] + ["dspark-wait-worker.service"])
    return app


def use_standin(app: Appliance, env: dict[str, str] | None = None, supervisor: dict | None = None,
                line_commands: dict[str, list[str]] | None = None,
                node_env: dict[str, dict[str, str]] | None = None) -> list[str]:
    """Put the stand-in vLLM in place of vLLM in the installed appliance's cluster file (before
    any unit starts; the units are unchanged): serving.vllm_command runs STANDIN with the
    runtime's interpreter, `env` is added to serving.env (the STANDIN_* behaviours, which every
    rank gets), `supervisor` to the supervisor section, and serving.line_commands becomes
    `line_commands`: the other lines a switch may move to (none when None); the file's own line
    runs vllm_command, the stand-in. `node_env`: {node: env} added to that [[nodes]] entry's env
    (a behaviour of one rank only). Returns the stand-in's command."""
    import tomllib

    from dspark.config import validate as C
    from dspark.config.template import dumps

    dest = app.box.path(STANDIN)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.parent.chmod(0o755)
    dest.write_text(STANDIN_SOURCE.read_text())
    dest.chmod(0o644)
    command = [app.python, STANDIN]
    path = app.box.path(f"{CLUSTER_DIR}/cluster.toml")
    data = tomllib.loads(path.read_text())
    data["serving"]["vllm_command"] = command
    data["serving"]["env"] = {**data["serving"].get("env", {}), **(env or {})}
    data["serving"]["line_commands"] = line_commands or {}
    data["supervisor"] = {**data["supervisor"], **(supervisor or {})}
    for entry in data["nodes"]:
        entry["env"] = {**entry.get("env", {}), **(node_env or {}).get(entry["name"], {})}
    C.from_dict(data)  # the file the units read must pass the same validation as prepare()'s
    path.write_text("# The local appliance with the stand-in vLLM (tests/systemd/appliance.use_standin).\n"
                    + dumps(data))
    app.standin = True
    return command


def record_real_start_ups(app: Appliance, what: str) -> int:
    """Record the real vLLM start-ups of this container (tests.harness.pair.record_start_ups): every
    "starting vLLM: " line in the head unit's whole journal (the first start, restarts, switches
    and rollbacks). Nothing for a stand-in appliance: it starts no real vLLM."""
    if app.standin:
        return 0
    r = app.box.run("journalctl", "--no-pager", "-o", "cat", "-u", app.unit(HEAD_NAME), timeout=60)
    return record_start_ups(what, count_head_starts(r.stdout), app.nodes)


def bind_checkout(box: Container, units: list[str]) -> None:
    """The units keep PrivateTmp=yes: a checkout under /tmp (a CI clone, say) would vanish
    inside them, so only then the test binds it back in, read-only, over the private /tmp."""
    checkout = Path(os.path.realpath(ROOT))
    if any(checkout.is_relative_to(t) for t in ("/tmp", "/var/tmp")):
        for unit in units:
            d = box.path(f"/etc/systemd/system/{unit}.d")
            d.mkdir(parents=True, exist_ok=True)
            (d / "91-test-checkout.conf").write_text(
                f"# tests only: this checkout lives under a private /tmp\n[Service]\nBindReadOnlyPaths={checkout}\n")
        box.systemctl("daemon-reload", check=True)


if __name__ == "__main__":  # a manual look: python -m tests.harness.appliance
    with Container() as c:
        a = install(c)
        print(c.systemctl("start", "dspark-head", timeout=600).returncode, a.user_note, file=sys.stderr)
        print(a.diagnose())
