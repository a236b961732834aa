"""Shared fixtures. The real local vLLM pair is started once per pytest session (`local_pair`)
and shared by every test that does not change it; a test that must change its pair (a kill, a
stop) takes a `fresh_pair` of its own and says why in one line. Every real start-up is recorded
(tests.harness.pair.record_start_ups) and .ci/run prints the count. Helpers shared by the test
folders live in tests/harness/ (tests is a package: everything imports as tests.harness.*)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.pair import ARTIFACTS, kill_leftovers, start_pair, vllm_groups
from tests.harness.standin import Serve


def _pair_fixture(workdir: Path, nodes: int = 2, env: dict[str, str] | None = None):
    pair = start_pair(workdir, nodes=nodes, env=env)  # cleans up itself when the pair does not come up
    groups: set[int] = set()
    try:
        groups = vllm_groups(pair)  # vLLM's engine and workers rename themselves: found by group
        yield pair
    finally:
        pair.stop()
        kill_leftovers(workdir, groups | pair.groups)


@pytest.fixture(scope="session")
def local_pair(tmp_path_factory):
    """The real two-node pair (vLLM CPU build), shared by every test that only reads it, then by
    the few that change it, which run last (`shared_pair_last`): the switches, then the drain's
    Ctrl-C. Where the second runtime line is installed, the pair knows it behind the switch
    tests' wrapper (switch_lib), in mode ok: the real vLLM of that line (`pair.lines`)."""
    from dspark.local import cluster as local
    from tests.harness.switch import second_line_wrapped

    lines = second_line_wrapped(tmp_path_factory.mktemp("lines"))
    for pair in _pair_fixture(tmp_path_factory.mktemp("pair"),
                              env={local.LINES_DIR_ENV: str(lines)} if lines is not None else None):
        pair.lines = lines
        yield pair


@pytest.fixture(scope="module")
def local_ring(tmp_path_factory):
    """The real four-node local appliance (TP=4 over four processes on 127.0.0.1 .. 127.0.0.4),
    for the module that reads it (its memory is freed before the next module's tests)."""
    yield from _pair_fixture(tmp_path_factory.mktemp("ring"), nodes=4)


@pytest.fixture
def fresh_pair(tmp_path):
    """A pair of this test's own, for a test that breaks it before others could read it (the kill -9
    of a vLLM, tests/local/test_no_orphans.py)."""
    yield from _pair_fixture(tmp_path / "pair")


@pytest.fixture
def browser():
    """Headless Chromium through Selenium (dashboard/browser.py), for the dashboard's pages and
    the local ring's; skips where Chromium is not installed."""
    from tests.harness.browser import chromium

    with chromium() as driver:
        yield driver


@pytest.fixture
def serve(tmp_path):
    """Starts `dspark serve` processes against the stand-in vLLM (tests.harness.standin.Serve); every one
    is killed and its notify socket closed after the test."""
    started: list[Serve] = []

    def start(cluster, node, *serve_args, **env):
        s = Serve(tmp_path, cluster, node, *serve_args, **env)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


# ------------------------------------------------------------------ the quick layer's time
SLOW_MARKS = ("pair", "vllm", "systemd", "nix", "browser", "load")
_quick: dict[str, float] = {}


_quick_ids: set[str] = set()


def pytest_collection_finish(session):
    """The tests of this run that carry none of the slow layers' marks (after the auto-marking)."""
    _quick_ids.update(item.nodeid for item in session.items
                      if not any(item.get_closest_marker(m) for m in SLOW_MARKS))


def pytest_runtest_logreport(report):
    """Time of every test that needs none of the slow layers (setup, call and teardown)."""
    if report.nodeid in _quick_ids:
        _quick[report.nodeid] = _quick.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if _quick:
        terminalreporter.write_line(f"quick layer (no {', '.join(SLOW_MARKS)} mark): {len(_quick)} tests, "
                                    f"{sum(_quick.values()):.0f} s of their own time")


PAIR_FIXTURES = {"local_pair", "fresh_pair", "local_ring"}
VLLM_FIXTURES = {"vllm"}  # test_config_sources.py: vLLM's config and argument parser, imported here
OVERLAY_TESTS = Path(__file__).parent / "overlay"


def _last_order(item) -> int:
    mark = item.get_closest_marker("shared_pair_last")
    return mark.args[0] if mark is not None else 0


def pytest_collection_modifyitems(items):
    """A test that takes a pair (directly or through a fixture of its own) is in the pair layer,
    marked or not, so `-m "not pair"` leaves it out. One that runs vLLM's own code (every overlay
    test, which drives copies of the installed tree in subprocesses; a test taking the `vllm`
    fixture) is in the vllm layer. The tests that change the shared pair
    (`@pytest.mark.shared_pair_last(N)`) run after every other test of the session, by N."""
    items.sort(key=_last_order)  # stable: every other test keeps its place
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if PAIR_FIXTURES & names:
            item.add_marker(pytest.mark.pair)
        if VLLM_FIXTURES & names or OVERLAY_TESTS in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.vllm)
