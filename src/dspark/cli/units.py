"""`dspark systemd`: render and install the units (imported only when the command runs)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import click

from dspark.cli.common import fail, load_cluster, pick_node
from dspark.cli.options import config_option
from dspark.units.dropins import NodeRole, node_dropins, node_units
from dspark.units.install import default_dspark_bin, install, systemd_running, unexecutable, write_files
from dspark.units.names import DEFAULT_CONFIG, USER
from dspark.units.render import render_units

if TYPE_CHECKING:
    from dspark.config.schema import Cluster


def _config_file(config_path: Path | None) -> str:
    """The cluster file's absolute path, as the drop-ins name it for the units."""
    return os.path.abspath(config_path or DEFAULT_CONFIG)


def _roles(cluster: Cluster, names: tuple[str, ...]) -> list[NodeRole]:
    return [NodeRole(n.name, n.is_head) for n in (pick_node(cluster, name) for name in names)]


def _bin(dspark_bin: str | None) -> str:
    try:
        return dspark_bin or default_dspark_bin()
    except FileNotFoundError as e:
        fail(str(e), 1)


@click.group("systemd")
def cli() -> None:
    """Render and install the systemd units (dspark-head, dspark-worker[@NODE] and their helpers)."""


CONFIG_OPT = config_option(also="The units read this file (DSPARK_CONFIG in their drop-ins).")
BIN_OPT = click.option("--dspark-bin", help="Path of the dspark executable in ExecStart= (default: this one).")


@cli.command("render")
@click.option("--node", "-n", "nodes", multiple=True,
              help="Also render this node's drop-ins (reads the cluster file; "
                   "repeat for a host running several nodes).")
@CONFIG_OPT
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Write the files into this directory instead of printing them.")
@BIN_OPT
def render_cmd(nodes: tuple[str, ...], config_path: Path | None, out: Path | None, dspark_bin: str | None) -> None:
    """Print (or write with --out) the unit files."""
    files = render_units(_bin(dspark_bin))
    if nodes:
        try:
            files.update(node_dropins(_roles(load_cluster(config_path), nodes), _config_file(config_path)))
        except ValueError as e:
            fail(str(e))
    if out is not None:
        for path in write_files(files, out):
            click.echo(str(path))
        return
    for name, text in files.items():
        click.echo(f"### {name}\n{text}")


@cli.command("install")
@click.option("--node", "-n", "nodes", multiple=True, required=True,
              help="The node this host runs (repeat for a host running several nodes).")
@CONFIG_OPT
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=Path("/"), show_default=True,
              help="Install under this root (then nothing is reloaded).")
@BIN_OPT
def install_cmd(nodes: tuple[str, ...], config_path: Path | None, root: Path, dspark_bin: str | None) -> None:
    """Write the units to /etc/systemd/system with this host's drop-ins, create the dspark
    user (systemd-sysusers) and reload systemd. Then: systemctl start dspark-worker (a worker;
    dspark-worker@NODE for each of several workers on one host) or dspark-head (rank 0);
    `systemctl enable` them to start at boot."""
    cluster = load_cluster(config_path)
    roles = _roles(cluster, nodes)
    dspark_bin = _bin(dspark_bin)
    try:
        written, commands = install(roles, _config_file(config_path), dspark_bin, root)
    except ValueError as e:
        fail(str(e))
    except (OSError, subprocess.CalledProcessError) as e:
        fail(f"install: {e}", 1)
    for path in written:
        click.echo(f"wrote {path}")
    for cmd in commands:
        click.echo("ran " + " ".join(cmd))
    if not systemd_running(root):
        click.echo("systemd is not running here (or --root was given): nothing reloaded")
    else:
        for why in unexecutable(dspark_bin, cluster.serving.vllm_command):
            click.secho(f"warning: the units run as user {USER}, who cannot execute what they start: {why}. "
                        f"Install dspark and the runtime where {USER} can (not under /root or a home directory "
                        "closed to others: a virtual environment under /opt/dspark, say) and pass --dspark-bin",
                        fg="yellow", err=True)
    units = node_units(roles)
    # Workers first: the head waits for them (and starts this host's own on its own).
    order = " ".join(units[r.name] for r in sorted(roles, key=lambda r: r.is_head))
    click.echo(f"next: systemctl start {order}   (enable them to start at boot)")
