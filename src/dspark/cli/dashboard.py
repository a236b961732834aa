"""`dspark dashboard`: only forwards its options to dashboard.server.serve()."""

from __future__ import annotations

from pathlib import Path

import click

from dspark.cli.options import config_option
from dspark.dashboard.collector import DEFAULT_INTERVAL_S
from dspark.dashboard.server import DEFAULT_PORT


@click.command("dashboard")
@config_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; anything but loopback needs --token-file.")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=click.IntRange(0, 65535), help="Port to bind.")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="File holding the access token (mode 600). Default: the systemd credential "
                   "'dashboard-token' when the unit loads one.")
@click.option("--node", default=None,
              help="The node this host is (its GPU and NVMe are read here). Default: $DSPARK_NODE, then the host name.")
@click.option("--interval", default=DEFAULT_INTERVAL_S, show_default=True, type=click.FloatRange(0.2, 60),
              help="Seconds between polls.")
def dashboard(config_path: Path | None, host: str, port: int, token_file: Path | None, node: str | None,
              interval: float) -> None:
    """Live web dashboard of the pair (read-only; one poller for every open page)."""
    from dspark.cli.common import fail, load_cluster
    from dspark.config.credentials import read_api_key
    from dspark.config.schema import ConfigError
    from dspark.dashboard.collector import Collector, Targets
    from dspark.dashboard.server import DashboardError, default_token_file, load_token, serve
    from dspark.log import NOTICE, line

    cluster = load_cluster(config_path)  # a bad cluster file: exit 2, as every command
    try:
        local = cluster.node(node).name
    except ConfigError:
        if node:
            fail(f"no node named {node!r} in {cluster.source}")
        local = None  # not one of the nodes: show n/a rather than guess whose hardware this is
    try:
        tf = token_file or default_token_file()
        token = load_token(tf) if tf else None
        collector = Collector(Targets.from_cluster(cluster, local_node=local), interval_s=interval,
                              api_token=read_api_key())
        code = serve(collector, host=host, port=port, token=token,
                     on_ready=lambda s: line(NOTICE, f"dashboard on {s.url}"))
    except DashboardError as e:  # the token file, or a non-loopback address without one: config
        fail(str(e))
    except OSError as e:  # the address cannot be bound: a runtime failure
        fail(f"cannot bind {host}:{port}: {e.strerror}", 1)
    raise SystemExit(code)
