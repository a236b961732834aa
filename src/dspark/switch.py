"""`dspark switch LINE`: move a serving pair to another installed runtime line, measured before
and after, rolled back on its own when the new line fails.

Typed once, on the head (it writes the head's state; nothing new listens):
  1. refuse what cannot work: an unknown line, one not installed (serving.line_commands), a
     setting the line cannot honour, a pair not serving, a switch already under way;
  2. the same decode benchmark (same prompts, same seed, salted caches) `repeats` times on the
     current line: the spread of those runs is the noise band;
  3. the head's state names the new line (dspark.lines.state): the head drains and restarts its
     vLLM on it, each worker follows its head (worker first into the rendezvous, the head's vLLM
     last: dspark.node.policy);
  4. the pair must serve on the new line within `timeout_s`; the benchmark runs once more;
  5. verdict: kept, or rolled back the same way to the previous line (still installed) when the
     new line did not serve in time, failed the benchmark, or its score fell below the band.
Every switch is kept in the head's state directory: switch-history.json (time, from, to,
verdict, band, time not serving; dspark.lines.history), recorded `running` before anything
changes, and switches/<id>/ (the reports and their comparison), all mode 0600.

Interrupted: Ctrl-C (or SIGTERM, SIGHUP: dspark.cli.switch) before the head's state changes ends
it `not started`; after, it rolls back; a second one during the rollback stops waiting and leaves
the rollback to the head, which completes and records it. A switch killed outright is gone on
with by the head (dspark.lines.history.resolve_abandoned).
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, cast

from dspark.bench.client import REQUEST_TIMEOUT_S
from dspark.config.schema import Cluster, ConfigError
from dspark.files import state_io
from dspark.files.safe_read import NotRegularFile, describe
from dspark.lines import history as H
from dspark.lines import state as line_state
from dspark.lines.history import Record
from dspark.node import states as S
from dspark.node.agent_client import agent_state
from dspark.node.startup import running_line

if TYPE_CHECKING:
    from dspark.bench.report import Report

REPORTS = "switches"
POLL_S = 0.5
LOCK_WAIT_S = 2.0  # a head's check of an abandoned switch holds the lock for an instant: waited out
MIN_BAND = 0.05  # the smallest band: a score within 5 % of the old line's is never a regression

Progress = Callable[[str], None]


class SwitchRefused(Exception):
    """Nothing was changed: the switch cannot start (exit 2)."""


@dataclass
class Verdict:
    kept: bool
    reason: str
    before_score: float | None = None
    after_score: float | None = None
    gain: float | None = None
    band: float | None = None


def _gmean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def score(report: Report) -> float | None:
    """One figure for a decode report: the geometric mean of its levels' aggregate tok/s."""
    vals = [s.aggregate_tok_s for s in report.summary]
    if not vals or any(v is None or not math.isfinite(v) or v <= 0 for v in vals):
        return None
    return _gmean(vals)


def judge(before: list, after: list, min_band: float = MIN_BAND) -> Verdict:
    """Kept or not, from the reports of the runs on the old line and on the new one (the same
    workload each time). Throughput noise is a factor, not a difference, so everything is on the
    log scale: each side's score is the geometric mean of its runs' scores; the noise band is
    twice the largest log-distance of any run from its side's score, given as the drop it allows
    (for two runs: 1 - slower/faster), and at least `min_band`; the new line regresses when its
    score is below the old line's by more than the band. A measured band stays below 100 %: runs
    however far apart never make every drop look like noise."""
    before_scores = [score(r) for r in before]
    if not before_scores or any(s is None for s in before_scores):
        return Verdict(False, "the benchmark on the old line measured nothing")
    scores = cast("list[float]", before_scores)  # none is None: checked just above
    old = _gmean(scores)
    failed = next((r for r in after if r.error or score(r) is None), None)
    if not after or failed is not None:
        why = failed.error if failed is not None and failed.error else "nothing measured"
        return Verdict(False, f"the benchmark failed on the new line: {why}", old, None, None, None)
    news = cast("list[float]", [score(r) for r in after])  # none is None: `failed` is None
    new = _gmean(news)
    spread = max([abs(math.log(s / old)) for s in scores] + [abs(math.log(s / new)) for s in news])
    band = max(min_band, 1 - math.exp(-2 * spread))
    gain = new / old - 1
    if gain < -band:
        return Verdict(False, f"regression: score {new:.1f} tok/s vs {old:.1f} ({gain:+.1%}), beyond the noise "
                              f"band of {band:.1%}", old, new, gain, band)
    return Verdict(True, f"score {new:.1f} tok/s vs {old:.1f} ({gain:+.1%}), within the noise band of {band:.1%} "
                         "or better", old, new, gain, band)


@dataclass
class Bench:
    """The matrix run before and after (dspark.bench.decode), same prompts and seed each time."""

    concurrency: tuple[int, ...] = (1, 4)
    input_len: int = 128
    output_len: int = 128
    rounds: int = 2
    seed: int = 0
    repeats: int = 2          # runs on each line (the band needs two at least)
    min_band: float = MIN_BAND
    request_timeout_s: float = REQUEST_TIMEOUT_S


class Switcher:
    def __init__(self, cluster: Cluster, state_dir: Path, to: str, *, bench: Bench | None = None,
                 timeout_s: float | None = None, progress: Progress = print, api_key: str | None = None):
        self.cluster, self.state_dir, self.to = cluster, Path(state_dir), to
        self.bench = bench
        self.timeout_s = timeout_s if timeout_s is not None else H.timeout_s(cluster.supervisor)
        self.say = progress
        self.api_key = api_key
        self.file_line = cluster.serving.runtime_line
        self.t0 = time.monotonic()
        self._down_from: float | None = None  # the pair stopped serving then (across the switch and a rollback)

    # ------------------------------------------------------------------ preconditions
    def _states(self) -> dict[str, dict | None]:
        return {n.name: agent_state(n.agent_url, timeout=2.0) for n in self.cluster.nodes}

    def check(self) -> str:
        """The line the pair serves now; raises SwitchRefused with every reason it cannot switch."""
        from dspark.lines import runtime as runtime_lines

        c, to = self.cluster, self.to
        lines = runtime_lines.load()
        if to not in lines.lines:
            raise SwitchRefused(runtime_lines.unknown_line_message(to, lines).replace("serving.runtime_line", "LINE"))
        try:
            target = c.on_line(to)
        except ConfigError as e:
            raise SwitchRefused(e.problems[0]) from None
        settings = {k: getattr(target.serving, k) for k in runtime_lines.SETTINGS}
        refused = runtime_lines.refusals(to, settings, lines)
        if refused:
            raise SwitchRefused(f"runtime line {to} cannot run this cluster file: " + "; ".join(refused))
        states = self._states()
        self.resolve_abandoned(states)
        st = line_state.read(self.state_dir)
        if st is not None and st.switch is not None:
            sw = st.switch
            owner = f", dspark switch pid {sw.owner_pid}" if sw.owner_pid else ""
            raise SwitchRefused(f"a switch is under way ({sw.from_line} -> {sw.to_line}, {sw.id}{owner}); "
                                "wait for its verdict (dspark switch --history)")
        head = c.head
        hs = states[head.name]
        if hs is None:
            raise SwitchRefused(f"the head's agent at {head.agent_url} does not answer: is the pair running? "
                                "(dspark switch runs on the head, against the serving pair)")
        current = hs.get("runtime_line") or self.file_line
        not_serving = [f"{name} is {(s or {}).get('state', 'unreachable')}" for name, s in states.items()
                       if (s or {}).get("state") != S.SERVING]
        if not_serving:
            raise SwitchRefused("the pair is not serving (" + ", ".join(not_serving) + "); a switch starts from a "
                                "serving pair, so that the old line is measured and can be returned to")
        lagging = [f"{name} runs {(s or {}).get('runtime_line')}" for name, s in states.items()
                   if (s or {}).get("runtime_line") != current]
        if lagging:
            raise SwitchRefused(f"the nodes are not on one line (the head runs {current}; " + ", ".join(lagging) + ")")
        return current

    def resolve_abandoned(self, states: dict[str, dict | None]) -> None:
        """An earlier switch whose dspark switch is gone: gone on with, as the head does it
        (dspark.lines.history), as the state directory's owner, from the nodes' `states`."""
        st = line_state.read(self.state_dir) if self.state_dir.is_dir() else None
        if st is None or st.switch is None:
            return
        lines = {(s or {}).get("runtime_line") if (s or {}).get("state") == S.SERVING else None
                 for s in states.values()}
        serving_on = lines.pop() if len(lines) == 1 else None
        with state_io.as_owner_of(self.state_dir):
            rec = H.resolve_abandoned(self.state_dir, self.file_line, by="the next dspark switch",
                                      serving_on=serving_on, limit_s=self.timeout_s)
        if rec is not None:
            self.say(f"an earlier switch ({rec.id}) had lost its dspark switch: {rec.verdict}: {rec.reason}")

    # ------------------------------------------------------------------ the steps
    def _set_line(self, line: str, switch: line_state.Switch | None) -> None:
        line_state.write(self.state_dir, line_state.LineState(line, self.file_line, switch))

    def _wait_serving(self, line: str, timeout_s: float, rec: Record) -> tuple[bool, str, float | None]:
        """Wait until every node serves on `line`. Returns (ok, why not, seconds not serving):
        from the first poll that found the head not serving (in this wait or an earlier one
        that ended without it serving again) to this one finding every node serving."""
        deadline = time.monotonic() + timeout_s
        shown: dict[str, tuple] = {}
        while True:
            now = time.monotonic()
            states = self._states()
            hs = states[self.cluster.head.name]
            if self._down_from is None and (hs is None or hs.get("state") != S.SERVING):
                self._down_from = now
            for name, s in states.items():
                seen = ((s or {}).get("state", "unreachable"), (s or {}).get("runtime_line"))
                if shown.get(name) != seen:
                    shown[name] = seen
                    detail = (s or {}).get("detail") or ""
                    self.say(f"  {name:<13} {seen[0]:<10} line {seen[1] or '-':<8} {detail}  "
                             f"[{now - self.t0:5.1f} s]")
            if all(s and s.get("state") == S.SERVING and s.get("runtime_line") == line for s in states.values()):
                down, self._down_from = (now - self._down_from) if self._down_from is not None else 0.0, None
                return True, "", down
            failed = [f"{n}: {str(s.get('detail')).split('; holding')[0]}" for n, s in states.items()
                      if s and s.get("state") == S.FAILED and s.get("runtime_line") == line]
            if failed:
                return False, f"failed on {line}: " + "; ".join(failed), None
            if now >= deadline:
                late = ", ".join(f"{n} is {(s or {}).get('state', 'unreachable')} on "
                                 f"{(s or {}).get('runtime_line') or '-'}" for n, s in states.items())
                return False, f"not serving on {line} within {timeout_s:g} s ({late})", None
            time.sleep(POLL_S)

    def _bench(self, label: str, rec: Record) -> Report | None:
        from dspark.bench import decode
        from dspark.bench.client import BenchError, Target
        from dspark.bench.report import paths, to_markdown

        b = self.bench
        assert b is not None  # run() benchmarks only with a bench (not --no-bench)
        out = self.state_dir / REPORTS / rec.id
        out.mkdir(parents=True, exist_ok=True)
        target = Target(url=self.cluster.head.api_url.rstrip("/"), model=self.cluster.model.served_name,
                        token=self.api_key, timeout_s=b.request_timeout_s)
        spec = decode.DecodeSpec(concurrency=b.concurrency, input_len=b.input_len, output_len=b.output_len,
                                 rounds=b.rounds, seed=b.seed, label=label)
        p = paths(out, "decode", label)
        self.say(f"bench {label}: decode, concurrency {','.join(map(str, b.concurrency))}, {b.input_len} in / "
                 f"{b.output_len} out, {b.rounds} round(s), seed {b.seed}")
        try:
            report = decode.run(target, spec, on_update=lambda r: r.save(p.json),
                                settings={"runtime_line": label.split("-")[0]})
        except BenchError as e:
            self.say(f"bench {label}: {e}")
            return None
        report.save(p.json)
        p.markdown.write_text(to_markdown(report))
        rec.reports.append(str(p.json))
        s = score(report)
        self.say(f"bench {label}: score {'-' if s is None else f'{s:.1f}'} tok/s "
                 f"(geometric mean of the levels' aggregate tok/s){'; ' + report.error if report.error else ''}")
        return report

    def run(self) -> Record:
        current = self.check()
        if current == self.to:
            raise SwitchRefused(f"the pair already serves runtime line {self.to}")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        try:  # the state directory is the service user's: a link or a FIFO planted there is refused
            lock = state_io.open_lock(self.state_dir / H.LOCK)
        except NotRegularFile as e:
            raise SwitchRefused(f"the switch's lock {describe(e)}") from None
        if not _flock_within(lock, LOCK_WAIT_S):
            lock.close()
            raise SwitchRefused("another dspark switch is running on this head") from None
        umask = os.umask(0o077)  # the reports under switches/ too are the service's alone (0600)
        try:
            # Root (`sudo dspark switch`) writes as the state directory's owner: the history, the
            # line state and the reports under switches/ (dspark.bench) reach nothing that user
            # could not reach itself, whatever links it planted.
            with state_io.as_owner_of(self.state_dir, adopt=(REPORTS,)):
                return self._run(current)
        finally:
            os.umask(umask)
            lock.close()

    def _run(self, current: str) -> Record:
        to = self.to
        rec = Record(id=time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{current}-to-{to}",
                     started_at=time.time(), from_line=current, to_line=to)
        self.say(f"switch {rec.id}: runtime line {current} -> {to}")
        try:  # recorded before anything changes: a switch killed at any step leaves its record
            H.save(self.state_dir, rec)
        except OSError as e:
            raise SwitchRefused(f"cannot write the switch's record: {os_error_text(e)}") from None
        before: list = []
        try:
            if self.bench is not None:
                for i in range(max(2, self.bench.repeats)):
                    r = self._bench(f"{current}-before-{i + 1}", rec)
                    if r is None or r.error:
                        rec.verdict, rec.reason, rec.serving_on = H.NOT_STARTED, "the benchmark failed on the old " \
                            f"line {current}; nothing was changed", current
                        return self._finish(rec)
                    before.append(r)
            self._set_line(to, line_state.owned_switch(rec.id, current, to))
            self.say(f"the head's state names {to}: the head drains and restarts on it, the worker(s) follow")
            ok, why, down = self._wait_serving(to, self.timeout_s, rec)
            verdict: Verdict | None = None
            if ok:
                rec.down_s = down
                self.say(f"serving on {to}; the pair did not serve for {down:.1f} s")
                if self.bench is not None:
                    after = []
                    for i in range(len(before)):
                        r = self._bench(f"{to}-after-{i + 1}", rec)
                        if r is None:
                            break
                        after.append(r)
                        if r.error:
                            break
                    if len(after) < len(before) and not any(r.error for r in after):
                        verdict = Verdict(False, "the benchmark failed on the new line")
                    else:
                        verdict = judge(before, after, self.bench.min_band)
                        self._compare(before[0], after[0], rec)
                        self._explain(before, after, verdict, current, to)
                else:
                    verdict = Verdict(True, "serving on the new line (no benchmark: --no-bench)")
            else:
                verdict = Verdict(False, why)
            rec.band, rec.gain = verdict.band, verdict.gain
            if verdict.kept:
                rec.verdict, rec.reason, rec.serving_on = H.KEPT, verdict.reason, to
                self._set_line(to, None)
                self.say(f"verdict: kept {to}: {verdict.reason}")
                return self._finish(rec)
            self.say(f"verdict: rolling back to {current}: {verdict.reason}")
            return self._rollback(rec, verdict.reason)
        except KeyboardInterrupt:
            if rec.verdict != H.RUNNING:
                raise  # the verdict is in (its rollback was interrupted: recorded there)
            if running_line(self.cluster, self.state_dir).line == current:  # the head's state: not moved yet
                rec.verdict, rec.reason = H.NOT_STARTED, "interrupted (Ctrl-C) before the switch"
                rec.serving_on = current
                return self._finish(rec)
            self.say(f"interrupted: rolling back to {current} (Ctrl-C again: leave the rollback to the nodes)")
            return self._rollback(rec, "interrupted (Ctrl-C)")

    def _rollback(self, rec: Record, reason: str) -> Record:
        back, to = rec.from_line, rec.to_line
        self._set_line(back, line_state.owned_switch(rec.id + "-rollback", to, back, rollback=True))
        try:
            ok, why, down = self._wait_serving(back, self.timeout_s, rec)
        except KeyboardInterrupt:
            # The state names the old line with the rollback's record: the head goes back (its
            # workers re-form the pair with it) and completes the rollback on its own once the
            # pair serves (dspark.lines.history.resolve_abandoned). Not waited for here.
            rec.reason = f"{reason}; interrupted again during the rollback to {back}: left to the head"
            self.say(f"interrupted again: not waiting; the head completes the rollback to {back} and records it "
                     "(dspark switch --history)")
            H.save(self.state_dir, rec)
            return rec
        if ok:
            rec.down_s = (rec.down_s or 0.0) + (down or 0.0)
            rec.verdict, rec.reason, rec.serving_on = H.ROLLED_BACK, reason, back
            self._set_line(back, None)
            self.say(f"rolled back: serving on {back} again; the pair did not serve for {rec.down_s:.1f} s in all")
        else:
            rec.verdict, rec.reason = H.ROLLBACK_FAILED, f"{reason}; the rollback: {why}"
            self._set_line(back, None)
            self.say(f"the rollback to {back} did not serve: {why}")
        return self._finish(rec)

    def _compare(self, before: Report, after: Report, rec: Record) -> None:
        from dspark.bench.compare import CompareRefused, table

        try:
            text = table(before, after)
        except CompareRefused as e:
            text = f"not comparable: {e}\n"
        path = self.state_dir / REPORTS / rec.id / "compare.md"
        state_io.write_atomic(path, text, mode=None)  # the switch's umask (077) makes it 0600
        rec.reports.append(str(path))
        self.say(text.rstrip())

    def _explain(self, before: list, after: list, verdict: Verdict, old: str, new: str) -> None:
        """The one figure the verdict used, with its band, and how both were formed (the table
        before it compares the first run of each line figure by figure; it is not the verdict)."""
        if verdict.before_score is None or verdict.after_score is None or verdict.band is None:
            return
        assert self.bench is not None and verdict.gain is not None  # judged: a bench ran, both sides scored

        def runs(reports: list) -> str:
            return ", ".join(f"{score(r):.1f}" for r in reports if score(r) is not None)

        inside = verdict.gain >= -verdict.band
        self.say("the verdict's figure (the table above compares the first runs figure by figure; not the verdict): "
                 "the decode score, the geometric mean of the levels' aggregate tok/s, per line the geometric mean "
                 f"of its {len(before)} runs")
        self.say(f"  {old}: {verdict.before_score:.1f} tok/s (runs {runs(before)})")
        self.say(f"  {new}: {verdict.after_score:.1f} tok/s (runs {runs(after)})")
        self.say(f"  gain {verdict.gain:+.1%}; noise band {verdict.band:.1%} (twice the largest factor between a run "
                 f"and its line's mean, at least --min-band {self.bench.min_band:.0%}): "
                 + ("within the noise or better: kept" if inside else "a drop beyond the noise: rolled back"))

    def _finish(self, rec: Record) -> Record:
        rec.ended_at = time.time()
        H.save(self.state_dir, rec)
        return rec


def _flock_within(lock: BinaryIO, wait_s: float) -> bool:
    """The exclusive lock, waiting out a holder that lets go within `wait_s` (a head's check of
    an abandoned switch holds it for an instant); False when it is still held."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)


def os_error_text(e: OSError) -> str:
    what = {errno.ENOSPC: "the filesystem is full", errno.EDQUOT: "the disk quota is exhausted",
            errno.EROFS: "the filesystem is read-only"}.get(e.errno or 0, e.strerror or str(e))
    return f"{e.filename or 'the state directory'}: {what}"


EXIT_CODES = {H.KEPT: 0, H.NOT_STARTED: 1, H.ROLLED_BACK: 1, H.ROLLBACK_FAILED: 3, H.RUNNING: 3}
DEFAULT_STATE_DIR = Path("/var/lib/dspark/head")  # the head unit's StateDirectory (dspark.units)
