"""The systemd units, as one name: what `unit_names` (names and paths), `unit_render` (the
unit text) and `unit_install` (writing and reloading) hold, re-exported for the callers and
tests that name `dspark.units`. The `dspark systemd` command group is `units_cli`."""

from __future__ import annotations

from .unit_install import (  # noqa: F401
    default_dspark_bin, install, systemd_running, unexecutable, write_files,
)
from .unit_names import (  # noqa: F401
    CACHE_ENV, DASHBOARD, DEFAULT_CONFIG, HEAD, INSTANCE_CHARS, LOCAL_PAIR_DROPIN, NODE_DROPIN, READY_TARGET,
    SYSTEM_UNIT_DIR, SYSUSERS_FILE, UNIT_NAMES, USER, WAIT_WORKER, WORKER, WORKER_TEMPLATE,
)
from .unit_render import (  # noqa: F401
    DEVICES, RESTART_SEC, START_LIMIT, START_TIMEOUT, STOP_TIMEOUT_S, WATCHDOG_S, NodeRole, dashboard_service,
    exec_path, exec_quote, node_dropins, node_service, node_units, ready_target, render_units, sysusers,
    wait_worker_service, worker_instance,
)
