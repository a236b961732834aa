"""`dspark local up`: the appliance on this machine (dspark.local), its defaults read from there."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .cli_common import fail
from .local import DEFAULT_DIR, DEFAULT_NODES, LocalError, LocalPorts, check_nodes, check_vision, up, vllm_command

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
