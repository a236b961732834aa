"""`dspark check` warns when others can write what the node runs (issue 33, item 7): the model
directory (vLLM runs its Python with trust_remote_code, the default), the cluster file, and
vLLM's runtime (its command, site-packages, the vllm package), each with the chmod that closes
it; a clean setup says nothing but one ok line. Real files and modes in the test's directory."""

from __future__ import annotations

import json
import os
import sys
import tomllib
from pathlib import Path

import pytest

from dspark.config.template import dumps
from dspark.local.model import TINY_MODEL
from dspark.preflight import perms
from dspark.units.user import ServiceUser
from tests.harness.dspark_cli import invoke_dspark
from tests.harness.standin import STANDIN, write_cluster


def setup(tmp_path: Path, **serving) -> Path:
    path = write_cluster(tmp_path)
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY_MODEL))
    data = tomllib.loads(path.read_text())
    data["serving"].update(load_format="dummy", **serving)
    path.write_text(dumps(data))
    return path


def check(path: Path) -> dict[str, dict]:
    r = invoke_dspark("check", "--config", str(path), "--node", "h", "--no-peers", "--json")
    assert "Traceback" not in r.stdout + r.stderr
    return {c["name"]: c for c in json.loads(r.stdout)["checks"] if c["name"].startswith("perms")}


def test_a_clean_setup_does_not_warn(tmp_path):
    got = check(setup(tmp_path))
    assert list(got) == ["perms"] and got["perms"]["status"] == "ok", got
    assert "can write the model directory, the cluster file and vLLM's runtime" in got["perms"]["seen"]


def test_a_world_writable_model_directory_and_its_files_warn_with_the_fix(tmp_path):
    path = setup(tmp_path)
    model = tmp_path / "model"
    (model / "modeling_x.py").write_text("print('run by trust_remote_code')\n")
    model.chmod(0o777)
    (model / "modeling_x.py").chmod(0o666)
    got = check(path)
    assert set(got) == {"perms.model"}, got
    w = got["perms.model"]
    assert w["status"] == "warn" and f"{model} (drwxrwxrwx, world-writable)" in w["seen"], w
    assert f"{model / 'modeling_x.py'} (-rw-rw-rw-, world-writable)" in w["seen"], w
    assert "trust_remote_code = true" in w["seen"], w  # the default: vLLM runs that file
    assert f"chmod o-w {model}" in w["fix"] and f"chmod o-w {model / 'modeling_x.py'}" in w["fix"], w
    r = invoke_dspark("check", "--config", str(path), "--node", "h", "--no-peers")
    assert "warn  perms.model" in r.stdout and f"fix: chmod o-w {model}" in r.stdout, r.stdout


def test_a_cluster_file_others_can_write_or_replace_warns(tmp_path):
    path = setup(tmp_path)
    path.chmod(0o646)
    got = check(path)
    assert set(got) == {"perms.cluster"} and f"{path} (-rw-r--rw-, world-writable)" in got["perms.cluster"]["seen"]
    assert got["perms.cluster"]["fix"] == f"chmod o-w {path}"
    path.chmod(0o644)
    tmp_path.chmod(0o777)  # its directory: anyone can put another file in its place
    try:
        got = check(path)
    finally:
        tmp_path.chmod(0o700)
    seen = got["perms.cluster"]["seen"]
    assert f"{tmp_path} (drwxrwxrwx, world-writable) lets others replace {path}" in seen, got
    assert f"chmod o-w {tmp_path}" in got["perms.cluster"]["fix"]
    assert "perms.model" in got  # the model directory sits in the same directory


def test_a_sticky_directory_like_tmp_is_fine_for_files_root_and_the_service_own(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    shared.chmod(0o1777)
    (shared / "cluster").mkdir()
    path = setup(shared / "cluster")
    assert set(check(path)) == {"perms"}


def test_a_runtime_others_can_write_warns(tmp_path):
    rt = tmp_path / "rt"
    (rt / "bin").mkdir(parents=True)
    (rt / "site" / "vllm").mkdir(parents=True)
    (rt / "site" / "vllm" / "__init__.py").write_text("")
    python = rt / "bin" / "python"  # the runtime's interpreter, whose site-packages hold vllm
    python.write_text(f"#!/bin/sh\nPYTHONPATH={rt / 'site'} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    path = setup(tmp_path, vllm_command=[str(python), str(STANDIN)])
    assert set(check(path)) == {"perms"}
    (rt / "site").chmod(0o777)  # anyone can drop a .pth there: it runs at every interpreter start
    (rt / "site" / "vllm" / "__init__.py").chmod(0o666)
    got = check(path)
    w = got["perms.runtime"]
    assert set(got) == {"perms.runtime"} and w["status"] == "warn", got
    assert f"{rt / 'site'} (drwxrwxrwx, world-writable)" in w["seen"], w
    assert f"{rt / 'site' / 'vllm' / '__init__.py'} (-rw-rw-rw-, world-writable)" in w["seen"], w
    assert f"chmod o-w {rt / 'site'}" in w["fix"], w


# ------------------------------------------------------------------------------ groups
def scan(path: Path, monkeypatch, members: dict[int, set[int]]) -> list[perms.Finding]:
    monkeypatch.setattr(perms.Trust, "members", lambda self, gid: frozenset(members.get(gid, ())))
    s = perms.Scan(perms.Trust(ServiceUser("dspark", 4000, frozenset({4000}), "test")))
    s.path(path)
    return [f for f in s.take() if f.path == path]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another group needs root")
def test_group_writable_counts_only_when_the_group_lets_someone_else_in(tmp_path, monkeypatch):
    f = tmp_path / "config.json"
    f.write_text("{}")
    os.chown(f, os.getuid(), 4242)
    f.chmod(0o664)
    [found] = scan(f, monkeypatch, {4242: {4000, 1001}})  # the service user and one more
    assert "group-writable by 4242" in found.seen and found.fix == f"chmod g-w {f}"
    assert scan(f, monkeypatch, {4242: {4000}}) == []            # the service user's own group
    assert scan(f, monkeypatch, {4242: {os.getuid(), 0}}) == []  # root and the owner, who can write it anyway
