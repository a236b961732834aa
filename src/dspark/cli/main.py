"""The `dspark` command line. Thin: each command parses its options and calls one function.

Library modules are imported inside the commands so that `dspark --help` stays fast.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from dspark.cli.common import config_found, fail, load_cluster, pick_node
from dspark.cli.options import config_option, node_option

if TYPE_CHECKING:
    from dspark.config.schema import Cluster, NodeConfig


class LazyGroup(click.Group):
    """Commands that live in their own modules, imported only when used or listed."""

    lazy = {
        "systemd": ("dspark.cli.units", "cli", "Render and install the systemd units."),
        "bench": ("dspark.cli.bench", "bench", "Benchmarks: prefill, decode, compare."),
        "dashboard": ("dspark.cli.dashboard", "dashboard", "Live dashboard of the pair (web page)."),
        "check": ("dspark.cli.check", "check", "Host preflight: fabric, RDMA, kernel, GPU, memory, model, "
                  "ports, peers."),
        "switch": ("dspark.cli.switch", "switch", "Move the pair to another runtime line, measured; rolled back on "
                   "failure."),
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """List the lazy commands from their stored help, without importing them."""
        rows = []
        for name in self.list_commands(ctx):
            if name in self.lazy:
                rows.append((name, self.lazy[name][2]))
            else:
                cmd = super().get_command(ctx, name)
                assert cmd is not None  # listed by the group itself
                rows.append((name, cmd.get_short_help_str(formatter.width - 6 - len(name))))
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        """A registered command's module, imported now: an ImportError there is a bug and
        surfaces with its traceback; only a name that is not registered is "No such command"."""
        if name in self.lazy:
            import importlib

            module, attr, _ = self.lazy[name]
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dspark", prog_name="dspark")
@click.pass_context
def main(ctx: click.Context) -> None:
    """dspark: DeepSeek V4 Flash on two DGX Spark / GX10 nodes, as a supervised appliance.

    One cluster file describes the deployment; every node runs `dspark serve`.
    """
    import signal

    # The entry point (dspark.__main__) ends the process quietly on a SIGINT until a command
    # is chosen; `serve` queues signals itself, every other command gets Python's usual Ctrl-C.
    if ctx.invoked_subcommand != "serve" and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# ------------------------------------------------------------------------------ config
@main.group("config")
def config_group() -> None:
    """Write and check the cluster file."""


@config_group.command("init")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path), default="cluster.toml")
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
def config_init(path: Path, force: bool) -> None:
    """Write a commented template (the tested DeepSeek V4 Flash settings) to PATH."""
    from dspark.config.template import template

    if path.exists() and not force:
        fail(f"{path} exists; pass --force to overwrite it")
    try:
        path.write_text(template())
    except OSError as e:
        fail(f"cannot write {path}: {e.strerror}")
    click.echo(f"wrote {path}; replace every CHANGEME, then run: dspark config check --config {path}")


@config_group.command("check")
@config_option
def config_check(config_path: Path | None) -> None:
    """Validate the cluster file; exit non-zero with every problem found."""
    cluster = load_cluster(config_path)
    nodes = ", ".join(f"{n.name} (rank {n.rank}, {n.address})" for n in sorted(cluster.nodes, key=lambda n: n.rank))
    click.echo(f"{cluster.source}: OK: {len(cluster.nodes)} nodes: {nodes}")


# ------------------------------------------------------------------------------ plan
@main.command("plan")
@config_option
@click.option("--model-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Model directory (default: model.path from the cluster file).")
@click.option("--published", is_flag=True,
              help="Plan for a published checkpoint from dspark's shipped description of its safetensors headers "
                   "(no model needed); without a cluster file, at the default settings.")
@click.option("--model", "published_model", metavar="NAME",
              help="With --published: which checkpoint, deepseek-v4-flash (the default), "
                   "deepseek-v4-flash-vision-exp or deepseek-v4.1-flash.")
@click.option("--nodes", type=click.IntRange(min=1),
              help="With --published: plan for this many nodes (tensor_parallel_size = nodes x gpus_per_node; "
                   "default: the cluster file's).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan_cmd(config_path: Path | None, model_dir: Path | None, published: bool, published_model: str | None,
             nodes: int | None, as_json: bool) -> None:
    """Memory fit plan: weights per rank, KV cache per token, KV tokens, the longest context."""
    import json

    from dspark.plan.facts import PlanError
    from dspark.plan.from_cluster import plan_for_cluster

    if not published and (published_model is not None or nodes is not None):
        raise click.UsageError("--model and --nodes go with --published")
    try:
        if published:
            from dspark.plan.published import NAME, plan_published

            plan = plan_published(load_cluster(config_path) if config_path or config_found() else None,
                                  model=published_model or NAME, nodes=nodes)
        else:
            plan = plan_for_cluster(load_cluster(config_path), model_dir)
    except PlanError as e:
        fail(f"plan: {e}")
    click.echo(json.dumps(plan.to_dict(), indent=2) if as_json else plan.render_text())
    if not plan.fits:
        raise click.exceptions.Exit(1)


# ------------------------------------------------------------------------------ render
@main.command("render")
@config_option
@node_option
@click.option("--json", "as_json", is_flag=True, help="Print argv and env as JSON.")
def render_cmd(config_path: Path | None, node: str | None, as_json: bool) -> None:
    """Print the exact vLLM command line and environment for a node (secrets redacted)."""
    import json

    from dspark.node.launch import render

    cluster = load_cluster(config_path)
    launch = render(cluster, pick_node(cluster, node))
    if as_json:
        click.echo(json.dumps({"argv": launch.redacted_argv(), "env": launch.redacted_env()}, indent=2))
    else:
        click.echo(launch.shell(), nl=False)


# ------------------------------------------------------------------------------ serve
# How long a start refused for a condition that can clear (a port another process holds, a full
# or read-only filesystem) waits before its exit 5, which the units restart (RestartSec=2): each
# failing start then lasts at least this long, so the units' start limit (10 starts in 10 min,
# unit_render.START_LIMIT) is never reached and the node keeps trying for as long as it takes.
TRANSIENT_WAIT_S = 120.0


@main.command("serve")
@config_option
@node_option
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), envvar="STATE_DIRECTORY",
              help="Where restarts are counted (default: $STATE_DIRECTORY from systemd).")
@click.option("--skip-plan", is_flag=True, help="Start even if the memory plan says it does not fit.")
@click.option("--check", "preflight", is_flag=True,
              help="Run `dspark check` first (the units do): refuse to start on a fail; every line is logged.")
@click.option("--transient-wait", "transient_wait_s", type=click.FloatRange(min=0), default=TRANSIENT_WAIT_S,
              show_default=True, metavar="SECONDS",
              help="A start refused for a condition that can clear (a port another process holds, a full or "
                   "read-only filesystem) waits this long, then exits 5, which the units restart. With --check, "
                   "a held port is looked at again after 1, 2, 4 ... 30 s, and the node starts once it frees.")
def serve_cmd(config_path: Path | None, node: str | None, state_dir: Path | None, skip_plan: bool,
              preflight: bool, transient_wait_s: float) -> None:
    """Run this node: supervise vLLM, report to systemd, serve the node agent.

    Exit codes: 0 stopped, 2 refused (config, host check or memory plan), 3 never became
    ready, 4 died while serving (or lost its pair), 5 refused for now (a port another process
    holds, a full or read-only filesystem: systemd restarts it).
    """
    import time

    from dspark.node.signals import SignalQueue

    # First of all: from here on a signal is queued for the supervisor's loop, never lost
    # while the cluster file and the plan are read, never a traceback.
    signals = SignalQueue().install()
    started = time.monotonic()
    from dspark import preflight as P
    from dspark.node.startup import Refusal, run, startup

    cluster = load_cluster(config_path)
    this = pick_node(cluster, node)
    plan = startup(cluster, this, state_dir=state_dir, signals=signals, say=lambda line: click.echo(line, err=True),
                   gate=P.gate if preflight else None, identity=P.identity, skip_plan=skip_plan,
                   transient_wait_s=transient_wait_s, started=started)
    code = plan if isinstance(plan, Refusal) else run(plan, lambda e: _serve_os_error(e, cluster, this, plan.state_dir))
    if isinstance(code, Refusal):
        if code.code == 0:  # a signal stopped the start: a plain line, not an error
            click.echo(code.message, err=True)
            sys.exit(0)
        fail(code.message, code.code)
    sys.exit(code)


# errno values that the cluster file or the install must fix: a refusal (2). Every other OSError
# of serve() (a port taken, a full or read-only filesystem, too many open files, an I/O error)
# can clear: exit 5, restarted.
_CONFIG_ERRNOS = frozenset({"ENOENT", "ENOTDIR", "EISDIR", "EACCES", "EPERM", "ENOEXEC", "ELOOP", "ENAMETOOLONG",
                            "EADDRNOTAVAIL"})


def _serve_os_error(e: OSError, cluster: Cluster, node: NodeConfig, state_dir: Path | None) -> tuple[str, bool]:
    """serve()'s OSError in words (what, where, which filesystem), and whether it can clear."""
    import errno

    what = e.strerror or str(e)
    retry = errno.errorcode.get(e.errno or 0) not in _CONFIG_ERRNOS
    if e.errno == errno.EADDRINUSE:  # the agent's bind, the one port serve() binds itself
        from dspark.preflight.ports import probe_ports

        where = f"{node.agent_bind}:{node.agent_port}"
        held = [u for u in probe_ports(cluster, node, Path("/proc"), None) if u.what == "agent_port" and u.held]
        who = f", held by {held[0].holder()}" if held else " (free again now)"
        return f"serve: cannot bind the agent's port {where}: {what}{who}", retry
    path = Path(e.filename) if isinstance(e.filename, (str, os.PathLike)) else None
    if path is not None and not path.is_absolute() and state_dir is not None:
        path = state_dir / path  # state_io writes relative to the state directory's descriptor
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        path = path or state_dir  # a write's error names no file: serve() writes in the state directory
        if path is not None:
            fs = _filesystem(path)
            kind = fs["type"] if fs["source"] in (fs["type"], "none") else f"{fs['type']} on {fs['source']}"
            if e.errno == errno.EROFS:
                return (f"serve: {what}: {path} (its filesystem, {kind}, is mounted read-only at {fs['mount']}; "
                        "remount it read-write)"), retry
            return (f"serve: {what}: {path} (the {kind} filesystem at {fs['mount']}: {fs['free']} free of "
                    f"{fs['size']}; free space there)"), retry
    return f"serve: {what}" + (f": {path}" if path is not None else ""), retry


def _filesystem(path: Path) -> dict[str, str]:
    """The mount that holds `path` (its nearest existing directory): mount point, type, source,
    free and total space, from /proc/self/mountinfo and statvfs."""
    here = Path(os.path.realpath(path))
    while not here.exists() and here != here.parent:
        here = here.parent
    out = {"mount": "?", "type": "?", "source": "?", "free": "?", "size": "?"}
    best = ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f.read(1 << 20).splitlines():
                head, _, tail = line.partition(" - ")
                fields, rest = head.split(), tail.split()
                if len(fields) < 5 or len(rest) < 2:
                    continue
                mount = _unescape(fields[4])
                # the deepest mount above `here`; of mounts stacked on one point, the last (the top)
                if (here == Path(mount) or Path(mount) in here.parents) and len(mount) >= len(best):
                    best = mount
                    out.update(mount=mount, type=rest[0], source=_unescape(rest[1]))
    except OSError:
        pass
    try:
        st = os.statvfs(here)
        out.update(free=_bytes(st.f_bavail * st.f_frsize), size=_bytes(st.f_blocks * st.f_frsize))
    except OSError:
        pass
    return out


def _unescape(field: str) -> str:
    """mountinfo's octal escapes (\\040 for a space)."""
    import re

    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


# ------------------------------------------------------------------------------ clients
@main.command("wait-worker")
@config_option
@click.option("--timeout", type=float, help="Seconds to wait (default: supervisor.worker_wait_timeout_s).")
def wait_worker_cmd(config_path: Path | None, timeout: float | None) -> None:
    """Block until every worker's agent reports the rendezvous (or serving)."""
    import time

    from dspark.node.notify import Notifier
    from dspark.status import wait_for_workers

    cluster = load_cluster(config_path)
    timeout = cluster.supervisor.worker_wait_timeout_s if timeout is None else timeout
    notify = Notifier()  # STATUS= lines under systemd (dspark-wait-worker.service), else nothing
    deadline = time.monotonic() + timeout

    def keep_going(waiting: list[str]) -> bool:
        left = max(0.0, deadline - time.monotonic())
        notify.status(f"waiting for {', '.join(waiting)} to enter the rendezvous ({left:.0f} s left)")
        return True

    ok, message = wait_for_workers(cluster, timeout, keep_going)
    notify.status(message)
    if not ok:
        fail(message, 1)
    click.echo(message)


@main.command("status")
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status_cmd(config_path: Path | None, as_json: bool) -> None:
    """Both nodes and the API in one table; exit 1 when the pair is not serving."""
    from dspark.config.credentials import read_api_key
    from dspark.local.cluster import LocalError, found_cluster_file  # /etc's, else the local appliance's
    from dspark.status import collect, render_table, to_json

    try:
        config_path = found_cluster_file(config_path, say=lambda line: click.echo(line, err=True))
    except LocalError as e:
        fail(str(e))
    cluster = load_cluster(config_path)
    snap = collect(cluster, token=read_api_key())
    click.echo(to_json(snap) if as_json else render_table(snap))
    if not snap["serving"]:
        raise click.exceptions.Exit(1)


# ------------------------------------------------------------------------------ local
class LocalGroup(LazyGroup):
    lazy = {"up": ("dspark.cli.local", "local_up_cmd", "Start the workers (127.0.0.2 ..) then the head "
                   "(127.0.0.1); Ctrl-C stops them all."),
            "switch": ("dspark.cli.switch", "local_switch", "Switch the running local appliance to another "
                       "runtime line (dspark switch)."),
            "down": ("dspark.cli.local", "local_down_cmd", "Stop the local appliance running from --dir."),
            "status": ("dspark.cli.local", "local_status_cmd", "Whether the local appliance runs from --dir, and "
                       "its nodes' status.")}


@main.group("local", cls=LocalGroup)
def local_group() -> None:
    """The two-node appliance (or N nodes) on this machine, with the real vLLM CPU build."""


# ------------------------------------------------------------------------------ overlay
@main.command("overlay", add_help_option=False,
              context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def overlay_cmd(args: tuple[str, ...]) -> None:
    """Apply or check the Spark patch series on an installed vLLM tree.

    dspark overlay {apply,check} SITE_PACKAGES [--dry-run] [--overlay-dir DIR]
    """
    from dspark.lines.overlay import main as overlay_main  # stdlib-only: the Nix build runs it without click

    sys.exit(overlay_main(list(args), prog="dspark overlay"))


if __name__ == "__main__":  # pragma: no cover
    main()
