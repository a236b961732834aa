"""A throwaway systemd-nspawn container running a real systemd, for tests and benchmarks.

How (see ../shared/reference/systemd-and-nix-here.md): in a private mount namespace, an
overlay of `/` with a tmpfs upper layer (nothing the container writes reaches the host), a
small boot target of our own (`systemd.mask=timers.target`, so the image's enabled services
stay off), `--register=no --keep-unit`, the repository (with .venv) bound read-only at the same
path. The container's systemd never runs in the host's root cgroup: nspawn is started inside
a cgroup made for it (name=systemd and unified hierarchies), which is removed afterwards.
The network namespace is the host's, so loopback ports are shared with the host.

Drive it with `Container.run(...)` (nsenter into all its namespaces). `stop()` always tears
everything down: orderly poweroff, then SIGKILL of the container's PID 1 (which ends its PID
namespace), then the cgroups and the scratch directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CGROUP_HIERARCHIES = (Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
TOOLS = ("systemd-nspawn", "nsenter", "unshare", "mount")

BOOT_TARGET = """[Unit]
Description=dspark tests: a minimal boot (no services enabled in the image start)
Requires=sysinit.target
After=sysinit.target
AllowIsolate=yes
"""

BOOT_SCRIPT = r"""
set -eu
mount -t tmpfs -o mode=755 tmpfs "$D"
mkdir -p "$D/upper" "$D/work" "$D/root"
mount -t overlay overlay -o "lowerdir=/,upperdir=$D/upper,workdir=$D/work" "$D/root"
mkdir -p "$D/root/etc/systemd/system"
printf '%s' "$BOOT_TARGET" > "$D/root/etc/systemd/system/dspark-test.target"
exec systemd-nspawn -q -D "$D/root" --register=no --keep-unit $BINDS \
    -b -- systemd.unit=dspark-test.target systemd.mask=timers.target
"""


def missing_requirements() -> str | None:
    """Why a container cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (systemd-nspawn, mounts, cgroups)"
    for tool in TOOLS:
        if shutil.which(tool) is None:
            hint = " (apt-get install systemd-container; .ci/setup --system)" if tool == "systemd-nspawn" else ""
            return f"{tool} not found{hint}"
    if not any((h / "cgroup.procs").exists() for h in CGROUP_HIERARCHIES):
        return "no writable cgroup hierarchy"
    return None


class ContainerError(RuntimeError):
    pass


class Container:
    def __init__(self, name: str = "dspark-test", binds_ro: tuple[Path, ...] = (ROOT,)):
        self.name = f"{name}-{os.getpid()}-{time.monotonic_ns() % 10**6}"
        self.binds_ro = binds_ro
        self.scratch: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.leader: int | None = None
        self.cgroups: list[Path] = []
        self.log_path: Path | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 90) -> Container:
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        self.scratch = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        mnt = self.scratch / "fs"
        mnt.mkdir()
        self.log_path = self.scratch / "console.log"
        for h in CGROUP_HIERARCHIES:
            if (h / "cgroup.procs").exists():
                cg = h / self.name
                cg.mkdir()
                self.cgroups.append(cg)
        binds = " ".join(f"--bind-ro={p}" for p in self.binds_ro)
        env = {**os.environ, "D": str(mnt), "BOOT_TARGET": BOOT_TARGET, "BINDS": binds}
        cgroups = self.cgroups

        def enter_cgroups() -> None:  # in the child, before exec: nspawn starts in our cgroups
            for cg in cgroups:
                (cg / "cgroup.procs").write_text(str(os.getpid()))

        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", BOOT_SCRIPT],
            env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=enter_cgroups, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while self.leader is None:
            if self.proc.poll() is not None:
                raise ContainerError(f"systemd-nspawn exited with {self.proc.returncode}:\n{self.console()}")
            if time.monotonic() > deadline:
                raise ContainerError(f"no container init after {timeout} s:\n{self.console()}")
            self.leader = _child_named(self.proc.pid, "systemd")
            time.sleep(0.1)
        while True:
            state = self.run("systemctl", "is-system-running", timeout=10).stdout.strip()
            if state in ("running", "degraded"):
                return
            if time.monotonic() > deadline:
                raise ContainerError(f"container's systemd is {state!r} after {timeout} s:\n{self.console()}")
            time.sleep(0.2)

    def stop(self, timeout: float = 120) -> None:
        """Orderly poweroff, else SIGKILL; then remove the cgroups and the scratch directory."""
        if self.proc is not None and self.proc.poll() is None:
            if self.leader is not None:
                self.run("systemctl", "poweroff", "--no-block", timeout=10)
            else:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                if self.leader is not None:
                    _kill(self.leader)  # PID 1 of the container: its whole PID namespace goes
                _kill(self.proc.pid)
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
        for cg in self.cgroups:
            _remove_cgroup(cg)
        self.cgroups = []
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    def console(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:] if self.log_path else ""
        except OSError:
            return ""

    # ------------------------------------------------------------------ driving it
    def run(self, *cmd: str, timeout: float = 60, check: bool = False, **kw) -> subprocess.CompletedProcess:
        """Run a command in every namespace of the container (its mounts, PIDs, systemd)."""
        if self.leader is None:
            raise ContainerError("container not started")
        try:
            cp = subprocess.run(["nsenter", "-t", str(self.leader), "-a", "--", *cmd], capture_output=True,
                                text=True, timeout=timeout, **kw)
        except subprocess.TimeoutExpired as e:
            raise ContainerError(f"{' '.join(cmd)}: no answer after {timeout} s") from e
        if check and cp.returncode != 0:
            raise ContainerError(f"{' '.join(cmd)} exited with {cp.returncode}:\n{cp.stdout}\n{cp.stderr}")
        return cp

    def systemctl(self, *args: str, timeout: float = 60, check: bool = False) -> subprocess.CompletedProcess:
        return self.run("systemctl", *args, timeout=timeout, check=check)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, *(f"--property={p}" for p in props), timeout=20, check=True).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def status(self, unit: str) -> str:
        return self.systemctl("status", "--no-pager", "--full", "--lines=0", unit, timeout=20).stdout

    def journal(self, unit: str, since_usec: int | None = None) -> list[tuple[float, str]]:
        """(unix time, message) of the unit's journal lines (systemd's own lines included)."""
        args = ["journalctl", "--no-pager", "-o", "short-unix", "-u", unit]
        if since_usec:
            args.append(f"--since=@{since_usec / 1e6:.6f}")
        out = self.run(*args, timeout=30).stdout
        lines = []
        for line in out.splitlines():
            stamp, _, rest = line.partition(" ")
            try:
                lines.append((float(stamp), rest))
            except ValueError:
                continue
        return lines

    def path(self, inside: str) -> Path:
        """A path inside the container, as seen from the host."""
        return Path(f"/proc/{self.leader}/root") / inside.lstrip("/")

    def __enter__(self) -> Container:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _child_named(ppid: int, comm: str) -> int | None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may contain spaces: split after the last ')'
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == ppid and name == comm:
            return int(entry)
    return None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _remove_cgroup(cg: Path, attempts: int = 50) -> None:
    """rmdir the cgroup tree bottom-up; SIGKILL any process still in it (all of them ours)."""
    for _ in range(attempts):
        if not cg.exists():
            return
        for dirpath, _dirnames, _files in os.walk(cg, topdown=False):
            d = Path(dirpath)
            try:
                pids = (d / "cgroup.procs").read_text().split()
            except OSError:
                pids = []
            for pid in pids:
                _kill(int(pid))
            try:
                d.rmdir()
            except OSError:
                pass
        time.sleep(0.1)
