"""`dspark check`: the host preflight on demand (imported only when the command runs)."""

from __future__ import annotations

from pathlib import Path

import click

from dspark.cli.options import config_option, node_option


@click.command("check")
@config_option
@node_option
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
@click.option("--no-peers", is_flag=True, help="Do not ask the peers' agents (cluster file, runtime, model, clock).")
def check(config_path: Path | None, node: str | None, as_json: bool, no_peers: bool) -> None:
    """Host preflight: fabric interface, RDMA and GID, kernel, GPU and driver, memory, swap and
    OOM killers, model directory, cache directories, ports, and the peers.

    One line per check: ok, warn or fail, what was seen, and the fix. Exit 1 on any fail
    (2: the cluster file is invalid)."""
    from dspark.cli.common import load_cluster, pick_node
    from dspark.preflight import Host, run

    cluster = load_cluster(config_path)
    this = pick_node(cluster, node)
    report = run(cluster, this, Host(peers=not no_peers))
    if as_json:
        click.echo(report.to_json())
    else:
        for line in report.lines():
            click.echo(line)
        click.echo(report.summary())
    if report.failed:
        raise click.exceptions.Exit(1)
