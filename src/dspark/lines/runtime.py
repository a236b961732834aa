"""Runtime lines: the vLLM releases dspark can run, as data (dspark/data/runtime_lines.toml).

A line names its vLLM release, its pins and lock, its overlay series (the patches upstream took
are dropped, with the release that took them) and its vocabulary: the cluster file's settings are
written in the seed line's vocabulary, and each line renders them to its own flag values and
environment, or refuses a setting it cannot honour with a message naming the line and the
setting. Pure: no vLLM import, no I/O beyond reading the packaged data file once.
"""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

# The cluster-file settings whose names differ between lines (serving.<setting>).
SETTINGS = ("kv_cache_dtype", "moe_backend")
# vLLM normalizes --moe-backend before matching it (config/kernel.py _normalize_moe_backend, 0.28.0
# and 0.32.0); the lookup does the same so a name vLLM takes is never refused.
_NORMALIZE = {"moe_backend": lambda v: v.lower().replace("-", "_")}


class LineDataError(Exception):
    """runtime_lines.toml contradicts itself (a bug in the data, found when it is read)."""


class LineRefusal(Exception):
    """A setting the chosen line cannot honour; `problems` holds one line per setting."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class Term:
    """What a line does with one seed-vocabulary name: send `name` (with `env`), or refuse."""

    name: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    needs: str | None = None  # the overlay patch that gives the name its meaning on this line
    refuse: str | None = None


@dataclass(frozen=True)
class Line:
    id: str
    vllm: str
    summary: str
    lock: str
    lock_state: str
    requirements: str
    pins: dict[str, str]
    # The line's series file, relative to the checkout (overlay/series, overlay/lines/<id>/series):
    # what dspark.lines.overlay and the flake's per-line runtime apply.
    series_file: str
    series: tuple[str, ...]  # the patches the series file applies, in order
    ported: tuple[str, ...]  # those of `series` rewritten against this line's release (beside its series file)
    # Those of `series` new on this line, with no patch of overlay/ behind them (beside its series file).
    own: tuple[str, ...]
    needs_port: tuple[str, ...]  # kept, but not yet applicable: the line's open work
    dropped: tuple[dict[str, str], ...]  # {patch, taken_in, evidence}
    open_work: dict[str, str]
    names: dict[str, tuple[str, ...]]  # setting -> the release's own names
    sources: dict[str, str]  # setting -> where those names were read
    vocabulary: dict[str, dict[str, Term]]  # setting -> seed name -> term
    # Where the line's vLLM serves a DeepSeek V4 checkpoint with a vision tower (config.json's
    # vision_n_layers > 0: DeepSeek-V4-Flash-Vision-Exp), or None when it cannot.
    deepseek_v4_vision: str | None = None

    @property
    def title(self) -> str:
        return f"runtime line {self.id} (vLLM {self.vllm})"


@dataclass(frozen=True)
class Rendered:
    """A line's rendering of the settings: the values for the flags, and environment it adds
    (under the cluster file's own env, which wins)."""

    values: dict[str, str | None]
    env: dict[str, str]


@dataclass(frozen=True)
class Lines:
    default: str
    lines: dict[str, Line]
    seed_meanings: dict[str, dict[str, str]]
    upstream_meanings: dict[str, dict[str, dict[str, str]]]
    # Lines dspark ran once and no longer does: line id -> why (the refusal names it).
    retired: dict[str, str] = field(default_factory=dict)

    def get(self, line_id: str) -> Line:
        try:
            return self.lines[line_id]
        except KeyError:
            raise LineRefusal([unknown_line_message(line_id, self)]) from None


def unknown_line_message(line_id: str, lines: Lines) -> str:
    known = f"known: {', '.join(sorted(lines.lines))} (default {lines.default})"
    if line_id in lines.retired:
        return f"serving.runtime_line: {line_id!r} was retired: {lines.retired[line_id]}; {known}"
    return f"serving.runtime_line: {line_id!r} is not a known runtime line; {known}"


def _term(raw: dict[str, Any], where: str) -> Term:
    known = {"name", "env", "needs", "refuse"}
    if set(raw) - known or ("name" in raw) == ("refuse" in raw):
        raise LineDataError(f"{where}: give either name (with env, needs) or refuse")
    return Term(name=raw.get("name"), env=dict(raw.get("env", {})), needs=raw.get("needs"),
                refuse=raw.get("refuse"))


def _line(line_id: str, raw: dict[str, Any]) -> Line:
    names = raw.get("names", {})
    series = raw.get("series", {})
    return Line(
        id=line_id, vllm=raw["vllm"], summary=raw["summary"], lock=raw["lock"], lock_state=raw["lock_state"],
        requirements=raw["requirements"], pins=dict(raw["pins"]), series_file=raw["series_file"],
        series=tuple(series.get("applies", ())), ported=tuple(series.get("ported", ())),
        own=tuple(series.get("own", ())),
        needs_port=tuple(series.get("needs_port", ())),
        dropped=tuple(dict(d) for d in raw.get("dropped", ())), open_work=dict(raw.get("open_work", {})),
        names={s: tuple(names[s]) for s in SETTINGS},
        sources={s: names[f"{s}_source"] for s in SETTINGS},
        vocabulary={s: {k: _term(v, f"lines.{line_id}.vocabulary.{s}.{k}")
                        for k, v in raw.get("vocabulary", {}).get(s, {}).items()} for s in SETTINGS},
        deepseek_v4_vision=raw.get("deepseek_v4_vision"),
    )


def parse(data: dict[str, Any]) -> Lines:
    """Build and check the lines from the parsed data file."""
    lines = Lines(
        default=data["default"],
        lines={k: _line(k, v) for k, v in data["lines"].items()},
        seed_meanings={s: dict(data.get("seed_meanings", {}).get(s, {})) for s in SETTINGS},
        upstream_meanings={release: {s: dict(v.get(s, {})) for s in SETTINGS}
                           for release, v in data.get("upstream_meanings", {}).items()},
        retired={k: str(v["why"]) for k, v in data.get("retired", {}).items()},
    )
    problems = check_data(lines)
    if problems:
        raise LineDataError("; ".join(problems))
    return lines


def check_data(lines: Lines) -> list[str]:
    """The data's own rules: the default exists; every seed-meaning name is handled explicitly
    by every line (mapped, or refused), so it never falls through to a release's own name of the
    same spelling; a mapped name exists on the line (its release's or its overlay's, through a
    patch the line applies); no line sends a seed meaning under a name its release defines with
    another meaning (the `nvfp4_ds_mla` collision from vLLM 0.30.0 on)."""
    p: list[str] = []
    if lines.default not in lines.lines:
        p.append(f"default {lines.default!r} is not a line")
    p += [f"{k}: both a line and retired" for k in sorted(set(lines.retired) & set(lines.lines))]
    for line in lines.lines.values():
        if not set(line.ported) <= set(line.series):
            p.append(f"{line.id}: ported {', '.join(sorted(set(line.ported) - set(line.series)))} "
                     "not in the line's series")
        own, dropped = set(line.own), {d["patch"] for d in line.dropped}
        if not own <= set(line.series):
            p.append(f"{line.id}: own {', '.join(sorted(own - set(line.series)))} not in the line's series")
        for listed, what in ((set(line.ported), "ported"), (dropped, "dropped")):
            if own & listed:
                p.append(f"{line.id}: {', '.join(sorted(own & listed))} both own and {what}")
        if set(line.needs_port) & set(line.series):
            p.append(f"{line.id}: {', '.join(sorted(set(line.needs_port) & set(line.series)))} both applies "
                     "and needs a port")
        for setting in SETTINGS:
            vocab = line.vocabulary[setting]
            for seed_name in lines.seed_meanings[setting]:
                if seed_name not in vocab:
                    p.append(f"{line.id}: {setting} {seed_name!r} carries the seed line's meaning and the line "
                             "does not say what it does with it (a name, or a refusal)")
            for seed_name, term in vocab.items():
                if term.name is None:
                    continue
                if term.needs is not None and term.needs not in line.series:
                    p.append(f"{line.id}: {setting} {seed_name!r} needs {term.needs}, which the line does not apply")
                overlay_name = term.needs is not None and term.name == seed_name
                if term.name not in line.names[setting] and not overlay_name:
                    p.append(f"{line.id}: {setting} {seed_name!r} is sent as {term.name!r}, which vLLM "
                             f"{line.vllm} does not have ({line.sources[setting]})")
                meaning = lines.seed_meanings[setting].get(seed_name)
                other = lines.upstream_meanings.get(line.vllm, {}).get(setting, {}).get(term.name)
                if meaning is not None and other is not None:
                    p.append(f"{line.id}: {setting} {seed_name!r} would be sent as {term.name!r}, which on vLLM "
                             f"{line.vllm} means {other}")
    return p


@functools.cache
def load() -> Lines:
    """The packaged lines (read once)."""
    text = resources.files("dspark").joinpath("data/runtime_lines.toml").read_text(encoding="utf-8")
    return parse(tomllib.loads(text))


def render_settings(line: Line, settings: dict[str, str | None]) -> Rendered:
    """The line's values for the settings (None stays None: the flag is left out) and the
    environment they need; raises LineRefusal naming the line and every setting it refuses."""
    values: dict[str, str | None] = {}
    env: dict[str, str] = {}
    problems: list[str] = []
    for setting in SETTINGS:
        value = settings.get(setting)
        if value is None:
            values[setting] = None
            continue
        key = _NORMALIZE.get(setting, str)(value)
        term = line.vocabulary[setting].get(key)
        if term is not None and term.refuse is not None:
            problems.append(f"serving.{setting} = {value!r}: the {line.title} cannot honour it: {term.refuse}")
        elif term is not None:
            values[setting] = term.name
            env.update(term.env)
        elif key in line.names[setting]:
            values[setting] = value  # the release's own name, as written
        else:
            problems.append(f"serving.{setting} = {value!r}: the {line.title} has no {setting} of that name "
                            f"({line.sources[setting]}: {', '.join(line.names[setting])})")
    if problems:
        raise LineRefusal(problems)
    return Rendered(values=values, env=env)


def refusals(line_id: str, settings: dict[str, str | None], lines: Lines | None = None) -> list[str]:
    """Every problem with rendering `settings` on the line named `line_id` (empty: it can)."""
    lines = lines or load()
    try:
        render_settings(lines.get(line_id), settings)
    except LineRefusal as e:
        return e.problems
    return []


def vision_refusal(line: Line, lines: Lines, model_config: dict[str, Any]) -> str | None:
    """Why `line` cannot serve the model whose config.json is `model_config` (a DeepSeek V4
    checkpoint with a vision tower on a line whose vLLM has no DeepSeek V4 VL model), or None."""
    if not isinstance(model_config.get("vision_n_layers"), int) or model_config["vision_n_layers"] <= 0:
        return None
    if model_config.get("model_type") != "deepseek_v4" or line.deepseek_v4_vision is not None:
        return None
    return (f"{line.title} cannot serve this checkpoint: its config.json has a vision tower "
            f"(vision_n_layers {model_config['vision_n_layers']}, DeepSeek-V4-Flash-Vision-Exp), and vLLM "
            f"{line.vllm} has no DeepSeek V4 vision model (it would load the text model and stop at the "
            "vision weights)")


def vision_fix(lines: Lines) -> str:
    """What to do about vision_refusal: the lines that serve it."""
    able = [line.id for line in lines.lines.values() if line.deepseek_v4_vision is not None]
    if not able:
        return "no runtime line dspark offers serves it"
    return f"set serving.runtime_line = {able[0]!r} in the cluster file, or `dspark switch {able[0]}`"
