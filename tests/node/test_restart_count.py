"""RESTARTS counts the restarts of this running node: a start after a clean
stop is a fresh start (0), a start after a failure exit counts one more. Against a real
`dspark serve` with the stand-in vLLM and one state directory across the runs."""

import os
import signal

from tests.harness.standin import write_cluster


def run_once(serve, cluster, how: str) -> int:
    s = serve(cluster, "h")
    s.read(until="READY=1")
    restarts = s.state()["restarts"]
    s.proc.send_signal(signal.SIGTERM if how == "clean" else signal.SIGHUP)  # SIGHUP: exit 4, a failure
    assert s.wait() == (0 if how == "clean" else 4)
    s.close()
    os.unlink(s.sock_path)  # the next run binds its notify socket at the same path
    return restarts


def test_restarts_count_this_run_not_every_start_ever(tmp_path, serve):
    cluster = write_cluster(tmp_path)
    assert run_once(serve, cluster, "clean") == 0
    assert run_once(serve, cluster, "clean") == 0  # stopped cleanly, started again: a fresh node
    assert run_once(serve, cluster, "failure") == 0
    assert run_once(serve, cluster, "clean") == 1  # restarted after the failure
    assert run_once(serve, cluster, "clean") == 0
