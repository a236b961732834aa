"""`dspark local up`, `local down` and `local status`: the appliance on this machine (dspark.local),
its defaults read from there. `dspark status` with no cluster file named reads the local
appliance's (`found_cluster_file`) when /etc has none."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from dspark.cli.common import fail
from dspark.local.appliance import up
from dspark.local.cluster import (
    DEFAULT_DIR,
    DEFAULT_NODES,
    LocalError,
    LocalPorts,
    check_nodes,
    check_vision,
    vllm_command,
)
from dspark.local.lock import holder, left_behind, lock_path
from dspark.local.stop import down
from dspark.status import cli_command

_PORTS = LocalPorts()


def _local_nodes(ctx: click.Context, param: click.Parameter, value: int) -> int:
    try:
        check_nodes(value)
    except LocalError as e:
        raise click.BadParameter(str(e).split(": ", 1)[1]) from None
    return value


def _local_line(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    try:
        vllm_command(value)  # known, and installed here
    except LocalError as e:
        raise click.BadParameter(str(e)) from None
    return value


@click.command("up")
@click.option("--dir", "workdir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_DIR,
              show_default=True, help="Where the cluster file, tiny model, logs and state go.")
@click.option("--api-port", type=int, default=_PORTS.api, show_default=True, help="Head API port on 127.0.0.1.")
@click.option("--agent-port", type=int, default=_PORTS.agent, show_default=True,
              help="Agent port (each node's address).")
@click.option("--master-port", type=int, default=_PORTS.master, show_default=True, help="Rendezvous port.")
@click.option("--compile", "compile_", is_flag=True, help="Let vLLM torch.compile the model (slow start).")
@click.option("--nodes", type=int, default=DEFAULT_NODES, show_default=True, callback=_local_nodes,
              help="Nodes (ranks) on 127.0.0.1 .. 127.0.0.N, tensor parallel over all of them (2 or 4).")
@click.option("--line", default=None, callback=_local_line, metavar="LINE",
              help="Runtime line every node runs (serving.runtime_line; default: the default line, the vLLM "
                   "beside this dspark); another line's CPU build is the one .ci/setup put in .venv-lines/LINE.")
@click.option("--vision", is_flag=True,
              help="Serve a tiny random vision model (Idefics3) in place of the text one: chat messages may carry "
                   "an image (image_url). Needs a line whose vLLM serves it (--line v0.32.0).")
def local_up_cmd(workdir: Path, api_port: int, agent_port: int, master_port: int, compile_: bool,
                 nodes: int, line: str | None, vision: bool) -> None:
    """Start the workers (127.0.0.2 ..) then the head (127.0.0.1); Ctrl-C stops them all."""
    if vision:
        try:
            check_vision(line, nodes)
        except LocalError as e:
            raise click.UsageError(str(e)) from None
    try:
        code = up(workdir, LocalPorts(api=api_port, master=master_port, agent=agent_port), compile=compile_,
                  nodes=nodes, line=line, vision=vision)
    except LocalError as e:
        fail(f"local up: {e}", 1)
    sys.exit(code)


_DIR_HELP = "The local appliance's directory (what `local up --dir` was given)."


@click.command("down")
@click.option("--dir", "workdir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_DIR,
              show_default=True, help=_DIR_HELP)
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="How long to wait for it to stop (default: its stop's bound, from its cluster file: "
                   "drain_s + stop_grace_s + 15 s).")
def local_down_cmd(workdir: Path, timeout_s: float | None) -> None:
    """Stop the local appliance running from --dir (SIGTERM to its `local up`, as Ctrl-C would)."""
    try:
        down(workdir, timeout_s, progress=click.echo)
    except LocalError as e:
        fail(f"local down: {e}", 1)


@click.command("status")
@click.option("--dir", "workdir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_DIR,
              show_default=True, help=_DIR_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def local_status_cmd(workdir: Path, as_json: bool) -> None:
    """Whether the local appliance runs from --dir (its PID), and `dspark status` of its nodes."""
    from dspark.cli.common import load_cluster
    from dspark.config.credentials import read_api_key
    from dspark.status import collect, render_table, to_json

    cluster_file = workdir / "cluster.toml"
    h = holder(workdir)
    if not cluster_file.exists():
        fail(f"local status: no local appliance in {workdir}: no cluster.toml there; start one: "
             f"{cli_command()} local up{_dir_arg(workdir)}", 1)
    snap = collect(load_cluster(cluster_file), token=read_api_key())
    behind = [] if h.running else left_behind(workdir)
    snap["local"] = {"dir": str(workdir.resolve()), "running": h.running, "pid": h.pid, "left_behind": behind}
    if as_json:
        click.echo(to_json(snap))
    else:
        if h.running:
            click.echo(f"local appliance in {workdir}: running (PID {h.pid}); stop it: "
                       f"{cli_command()} local down{_dir_arg(workdir)}")
        elif behind:
            click.echo(f"local appliance in {workdir}: its `local up` is gone, but its supervisors "
                       f"{', '.join(map(str, behind))} still run; "
                       f"stop them: {cli_command()} local down{_dir_arg(workdir)}")
        else:
            click.echo(f"local appliance in {workdir}: not running (nothing holds {lock_path(workdir)})")
        click.echo(render_table(snap))
    if not snap["serving"]:
        raise click.exceptions.Exit(1)


def _dir_arg(workdir: Path) -> str:
    return "" if workdir == DEFAULT_DIR else f" --dir {workdir}"
