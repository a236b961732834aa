"""`dspark plan --published`: the plan of the published DeepSeek V4 Flash
checkpoint from dspark's shipped description of its safetensors headers, with no model on
disk and no cluster file; and the plan's hints name only settings the cluster file accepts
(item 10)."""

import json
import re

from dspark.plan import published
from tests.harness.dspark_cli import invoke_dspark
from tests.harness.plan_fixtures import CONFIG_PATH, write_dsv4_flash_checkpoint, write_tiny_llama

NO_CONFIG = {"DSPARK_CONFIG": None}  # unset for the call


def test_the_shipped_config_is_the_fixture_the_tests_use():
    assert published.config() == json.loads(CONFIG_PATH.read_text())


def test_published_description_has_the_published_figures():
    facts = published.published_facts()
    assert len(facts.tensors) == published.PUBLISHED_TENSOR_COUNT
    assert facts.weight_bytes == published.PUBLISHED_PAYLOAD_BYTES


def test_plan_published_without_a_model_or_a_cluster_file_equals_the_header_only_checkpoint(tmp_path):
    r = invoke_dspark("plan", "--published", "--json", env=NO_CONFIG, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    shipped = json.loads(r.stdout)
    # the same plan from a real (header-only, sparse) checkpoint directory at the default settings
    model = write_dsv4_flash_checkpoint(tmp_path / "dsv4")
    cluster = tmp_path / "c.toml"
    cluster.write_text(f'[model]\npath = "{model}"\n[[nodes]]\nname = "a"\nrank = 0\naddress = "10.0.0.1"\n'
                       '[[nodes]]\nname = "b"\nrank = 1\naddress = "10.0.0.2"\n')
    r = invoke_dspark("plan", "--config", str(cluster), "--json")
    assert r.returncode == 0, r.stderr
    on_disk = json.loads(r.stdout)
    # the description's shard sizes are the published ones; the fixture's compact headers differ
    assert shipped.pop("checkpoint_file_bytes") == published.PUBLISHED_SHARD_BYTES
    on_disk.pop("checkpoint_file_bytes")
    for d in (shipped, on_disk):
        d.pop("model_dir", None)
        d.get("inputs", {}).pop("model_dir", None)
    assert shipped == on_disk
    text = invoke_dspark("plan", "--published", env=NO_CONFIG, cwd=tmp_path).stdout
    assert "fits                      yes" in text and "KV tokens per rank        819,217" in text
    assert "note: 12 concurrent requests run with up to" in text
    assert "admission reserve" in text and "lower max_num_seqs" not in text


def test_published_follows_the_cluster_files_settings(tmp_path):
    cluster = tmp_path / "c.toml"
    cluster.write_text('[model]\npath = "/nowhere"\n[serving]\ntensor_parallel_size = 1\n'
                       '[[nodes]]\nname = "a"\nrank = 0\naddress = "10.0.0.1"\n')
    r = invoke_dspark("plan", "--published", "--config", str(cluster))
    assert r.returncode == 1 and "fits                      NO" in r.stdout, (r.stdout, r.stderr)


def test_plan_hints_name_only_settings_config_check_accepts(tmp_path):
    model = write_tiny_llama(tmp_path / "tiny")
    cluster = tmp_path / "c.toml"
    base = (f'[model]\npath = "{model}"\n[serving]\ntensor_parallel_size = 1\nspeculative_config = {{}}\n'
            'kv_cache_dtype = "auto"\nblock_size = 128\n')
    nodes = '[[nodes]]\nname = "a"\nrank = 0\naddress = "10.0.0.1"\n'
    cluster.write_text(base + nodes)
    r = invoke_dspark("plan", "--config", str(cluster))
    notes = [line for line in r.stdout.splitlines() if line.startswith("note:")]
    assert any("not estimated" in n for n in notes), r.stdout
    named = set(re.findall(r"serving\.([a-z_]+)", " ".join(notes)))
    assert named, notes  # the hint says which setting, in the cluster file's terms
    for key in named:  # what a user would then write into the file
        cluster.write_text(base + f"{key} = 1073741824\n" + nodes)
        check = invoke_dspark("config", "check", "-c", str(cluster))
        assert check.returncode == 0, (key, check.stderr)
    assert "runtime_overhead_bytes" not in r.stdout


def test_readme_shows_what_plan_published_prints(tmp_path):
    from tests.harness.docs_text import docs_text

    readme = docs_text()
    block = re.search(r"```\n\$ dspark plan --published\n(.*?)```", readme, re.S)
    assert block, "README.md and docs/: no '$ dspark plan --published' block"
    r = invoke_dspark("plan", "--published", env=NO_CONFIG, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert block.group(1).rstrip("\n") == r.stdout.rstrip("\n")
