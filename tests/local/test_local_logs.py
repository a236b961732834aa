"""`local up` starts each node's log afresh at each run and keeps the last run's as .log.1
(the logs grew across runs). A real `dspark serve` spawned the way local up
does, refused at once by a missing cluster file, writes the new log."""

from dspark.local.appliance import Pair


def test_each_run_starts_a_fresh_log_and_keeps_the_last_one(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "local-head.log").write_text("line from the run before\n")
    (logs / "local-head.log.1").write_text("line from two runs before\n")
    pair = Pair(tmp_path / "no-such-cluster.toml", tmp_path)
    p = pair.spawn("local-head")
    assert p.wait(timeout=60) != 0
    new, kept = (logs / "local-head.log").read_text(), (logs / "local-head.log.1").read_text()
    assert "run before" not in new and "no-such-cluster.toml" in new, new
    assert kept == "line from the run before\n"
