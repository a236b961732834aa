"""Options shared by every `dspark` command, declared once: `--config` (the cluster file) and
`--node` (this node's entry). The systemd units, the dashboard and bench take the very same
`--config` as `dspark serve`, so $DSPARK_CONFIG (what `dspark systemd install` writes into
the units' drop-ins) reaches every one of them. `parse_sizes` reads a list of sizes
("1K,2K") the same way for `bench` and `switch`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, overload

import click

CONFIG_HELP = "Cluster file (default: $DSPARK_CONFIG, then /etc/dspark/cluster.toml)."
NODE_HELP = "This node's name in the cluster file (default: $DSPARK_NODE, then the host name)."

F = TypeVar("F", bound=Callable[..., Any])


@overload
def config_option(f: F, *, also: str = "") -> F: ...
@overload
def config_option(f: None = None, *, also: str = "") -> Callable[[F], F]: ...


def config_option(f: F | None = None, *, also: str = "") -> F | Callable[[F], F]:
    """`--config/-c` into `config_path` (a Path, or None: then dspark.config.validate.load falls back to
    $DSPARK_CONFIG and /etc/dspark/cluster.toml). `also` adds a sentence to the help."""
    def deco(fn: F) -> F:
        return click.option("--config", "-c", "config_path", type=click.Path(dir_okay=False, path_type=Path),
                            envvar="DSPARK_CONFIG", help=CONFIG_HELP + (" " + also if also else ""))(fn)
    return deco(f) if f is not None else deco


def node_option(f: F) -> F:
    return click.option("--node", "-n", envvar="DSPARK_NODE", help=NODE_HELP)(f)


def parse_sizes(text: str, what: str) -> tuple[int, ...]:
    """'1K,2K,512' -> (1024, 2048, 512): a list of sizes in an option (bench, switch); a bad one
    is click's usage error (exit 2)."""
    out = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        mult = 1
        if part[-1] in "kK":
            part, mult = part[:-1], 1024
        try:
            value = int(part) * mult
        except ValueError:
            raise click.BadParameter(f"{part!r} is not a whole number (K = 1024 allowed)", param_hint=what) from None
        if value <= 0:
            raise click.BadParameter(f"{value} must be positive", param_hint=what)
        out.append(value)
    if not out:
        raise click.BadParameter("give at least one value", param_hint=what)
    return tuple(out)
