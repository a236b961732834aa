"""What every `dspark` command module shares, below them all: the one error idiom and the
cluster file as a command reads it. The root command line (`dspark.cli.main`) and the lazily
loaded command modules (`units_cli`, `bench.cli`, `dashboard.cli`, `preflight.cli`,
`switch_cli`) import these from here; nothing imports `dspark.cli.main`.

The idiom: a usage or config error is one red line on stderr and exit 2 (`fail`'s default);
a runtime failure passes its documented code (1, 3, ...). A bug is not an error for the user:
it keeps its traceback."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

if TYPE_CHECKING:
    from dspark.config.schema import Cluster, NodeConfig

EXIT_USAGE = 2  # bad input or config: the same code click gives a usage error


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """Print `message` (red, stderr) and end the command with `code` (raises click.exceptions.Exit)."""
    click.secho(message, fg="red", err=True)
    raise click.exceptions.Exit(code)


def load_cluster(config_path: Path | None) -> Cluster:
    """The cluster file (--config, else $DSPARK_CONFIG, else /etc/dspark/cluster.toml), or
    every problem found and exit 2."""
    from dspark.config.schema import ConfigError
    from dspark.config.validate import load

    try:
        return load(config_path)
    except ConfigError as e:
        fail(e.render())


def config_found() -> bool:
    """Whether a cluster file is there to be read without --config ($DSPARK_CONFIG or /etc)."""
    import os

    from dspark.config.schema import DEFAULT_CONFIG_PATH

    return bool(os.environ.get("DSPARK_CONFIG")) or DEFAULT_CONFIG_PATH.exists()


def pick_node(cluster: Cluster, name: str | None) -> NodeConfig:
    """This node's entry (--node, else $DSPARK_NODE, else the host name), or exit 2."""
    from dspark.config.schema import ConfigError

    try:
        return cluster.node(name)
    except ConfigError as e:
        fail(e.render())
