"""The serving defaults and where each comes from: every default in the
template names its source, `dspark render` of the template carries the GB10 settings, and vLLM
0.28.0's own code (parser, environment registry, CUDA-graph sizing and dispatch) takes them as
the template says."""

from __future__ import annotations

import dataclasses
import re
import warnings
from types import SimpleNamespace

import pytest

from dspark.config import checks
from dspark.config import validate as C
from dspark.config.schema import SEED_ENV, Cluster, ConfigError, ModelConfig, NodeConfig, ServingConfig
from dspark.config.template import template
from dspark.engine import graph_dispatch as G
from dspark.node.launch import render
from tests.harness.dspark_cli import invoke_dspark

K = 5  # DSpark's speculative tokens in the template: 6 verify rows per request
MULTIPLES_OF_6 = list(range(6, 73, 6))
# The template's capture sizes: every multiple of the 6 verify rows, and the draft's 5 and 35
# tokens (1 and 7 requests of DSpark's 5 query tokens, which no multiple of 6 rounds to).
TEMPLATE_SIZES = sorted(MULTIPLES_OF_6 + [5, 35])


def filled_template(tmp_path):
    text = (template().replace('"/var/lib/dspark/models/CHANGEME"', '"/models/dsv4"')
            .replace('"CHANGEME-head-hostname"', '"a"').replace('"CHANGEME-worker-hostname"', '"b"'))
    text = text.replace('address = "CHANGEME"', 'address = "10.0.0.1"', 1).replace(
        'address = "CHANGEME"', 'address = "10.0.0.2"', 1).replace('"CHANGEME"', '"eth1"')
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def flags(argv: list[str]) -> dict[str, list[str]]:
    """--flag -> its values (every word up to the next flag)."""
    out: dict[str, list[str]] = {}
    flag = None
    for a in argv:
        if a.startswith("--"):
            flag = a
            out[flag] = []
        elif flag is not None:
            out[flag].append(a)
    return out


def test_every_serving_default_in_the_template_names_its_source():
    fields = {f.name: f for f in dataclasses.fields(ServingConfig)}
    assert all(f.metadata.get("source") for f in fields.values()), \
        [n for n, f in fields.items() if not f.metadata.get("source")]
    serving = template().split("[serving]\n", 1)[1].split("\n\n", 1)[0].splitlines()
    keys = [i for i, line in enumerate(serving) if not line.startswith("#")]
    assert keys, serving
    for i in keys:
        key = serving[i].split(" = ", 1)[0]
        comment = []
        j = i - 1
        while j >= 0 and serving[j].startswith("#"):
            comment.insert(0, serving[j])
            j -= 1
        assert any(line.startswith("# Source: ") for line in comment), (key, comment)


def test_template_says_what_it_leaves_unset_and_why():
    text = template()
    head = text.split("[model]", 1)[0]
    assert "VLLM_SHM_BROADCAST_BUSY_LOOP_S" in head and "MiaAI-Lab PR #71" in head and "0.002 s applies" in head
    # The capture sizes follow max_num_seqs and the speculative tokens: shown, not written.
    shown = "# cudagraph_capture_sizes = [5, 6, 12, 18, 24, 30, 35, 36, 42, 48, 54, 60, 66, 72]  (unset: "
    assert shown in text.split("[serving]", 1)[1].split("[supervisor]", 1)[0]


def test_rendered_template_carries_the_gb10_defaults(tmp_path):
    """Through `dspark render`, as an operator sees it, and through render() for the argv."""
    path = filled_template(tmp_path)
    r = invoke_dspark("render", "--config", str(path), "--node", "a")
    assert r.returncode == 0, r.stderr
    assert "VLLM_USE_BREAKABLE_CUDAGRAPH=0 \\\n" in r.stdout
    assert "--long-prefill-token-threshold 1024 \\\n" in r.stdout
    assert "--gpu-memory-utilization 0.835 \\\n" in r.stdout
    assert "--cudagraph-capture-sizes 5 6 12 18 24 30 35 36 42 48 54 60 66 72 \\\n" in r.stdout

    cluster = C.load(path)
    for node in cluster.nodes:
        launch = render(cluster, node)
        f = flags(launch.argv)
        assert f["--cudagraph-capture-sizes"] == [str(n) for n in TEMPLATE_SIZES]
        assert "--max-cudagraph-capture-size" not in f  # vLLM takes the largest size as the maximum
        assert f["--long-prefill-token-threshold"] == ["1024"]
        assert f["--gpu-memory-utilization"] == ["0.835"]
        assert launch.env["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "0"


def test_capture_sizes_follow_the_verify_rows_and_the_operator():
    s = ServingConfig()
    assert s.capture_sizes == TEMPLATE_SIZES
    assert ServingConfig(max_num_seqs=6).capture_sizes == [5, *range(6, 37, 6)]
    assert ServingConfig(max_cudagraph_capture_size=36).capture_sizes == [5, 6, 12, 18, 24, 30, 35, 36]
    # 13 requests: 65 draft tokens, which no multiple of 6 up to 78 rounds to (it ran eager).
    assert ServingConfig(max_num_seqs=13).capture_sizes == sorted([*range(6, 79, 6), 5, 35, 65])
    # Another method's draft is not DSpark's: the verify rows alone.
    assert ServingConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 3}).capture_sizes \
        == list(range(4, 49, 4))
    assert ServingConfig(cudagraph_capture_sizes=[12, 6, 6]).capture_sizes == [6, 12]
    # Without speculative decoding vLLM's own list is left alone.
    plain = ServingConfig(speculative_config=None)
    assert plain.capture_sizes is None
    assert flags(render(_cluster(plain), _cluster(plain).head).argv)["--max-cudagraph-capture-size"] == ["12"]


def _cluster(serving: ServingConfig) -> Cluster:
    return Cluster(model=ModelConfig(path="/m"), serving=serving,
                     nodes=(NodeConfig(name="a", rank=0, address="10.0.0.1"),
                            NodeConfig(name="b", rank=1, address="10.0.0.2")))


def test_capture_sizes_that_leave_a_decode_batch_without_a_full_graph_are_refused(tmp_path):
    """A user's list or largest size is judged by dspark.engine.graph_dispatch (proven against vLLM's
    own managers in tests/overlay/test_graph_grid.py): one line naming the field, the batches,
    the mode they fall to on which release, and the fix; the fix itself passes."""
    def problems(**serving):
        return [x for x in checks.check(_cluster(ServingConfig(**serving))) if "FULL CUDA graph" in x]

    # Before the fix dspark itself rendered this list for 13 requests: the draft's last batch
    # (65 tokens) ran eager.
    old = list(range(6, 79, 6))
    p = problems(max_num_seqs=13, cudagraph_capture_sizes=old)
    assert p == ["serving.cudagraph_capture_sizes: leaves DSpark draft batches of 13 requests (NONE on 0.28.0) "
                 "without a FULL CUDA graph (vLLM's model runner v2 replays one only at a captured size of at "
                 "least a batch's tokens, rounded to whole requests); add 65 to it, or remove it for dspark's "
                 "list"], p
    assert not problems(max_num_seqs=13, cudagraph_capture_sizes=old + [65])
    assert not problems(max_num_seqs=13)  # dspark's own list
    # vLLM's own list: 5 and 9 requests verify PIECEWISE on 0.28.0 (FULL, padded, on 0.29.0).
    vllm_list = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72]
    p = problems(cudagraph_capture_sizes=vllm_list)
    assert len(p) == 1 and "verify batches of 5, 9 requests (PIECEWISE on 0.28.0)" in p[0], p
    assert p[0].endswith("; add 30, 54 to it, or remove it for dspark's list"), p
    assert not problems(cudagraph_capture_sizes=vllm_list + [30, 54])
    assert not problems(cudagraph_capture_sizes=vllm_list, runtime_line="v0.29.0", vllm_command=["vllm"])
    # A largest size below the verify rows of max_num_seqs requests.
    p = problems(max_cudagraph_capture_size=36)
    assert len(p) == 1 and p[0].startswith("serving.max_cudagraph_capture_size: leaves verify batches of "
                                           "7-12 requests (NONE on 0.28.0); DSpark draft batches of 8-12 "
                                           "requests (NONE on 0.28.0)"), p
    assert p[0].endswith("; raise it to 72, or remove it for dspark's list"), p
    assert not problems(max_cudagraph_capture_size=72)
    # Without speculative decoding vLLM's own list drops its FULL graphs above max_num_seqs
    # tokens, so no largest size covers 9..12 requests: a whole list is named.
    p = problems(speculative_config=None, max_cudagraph_capture_size=8)
    assert p and p[0].endswith("; set cudagraph_capture_sizes = [1, 2, 4, 8, 9, 10, 11, 12] instead"), p
    assert not problems(speculative_config=None, cudagraph_capture_sizes=[1, 2, 4, 8, 9, 10, 11, 12])
    # No graphs, nothing to cover.
    assert not problems(max_cudagraph_capture_size=36, extra_args=["--enforce-eager"])

    # Through the command a user runs: `dspark config check` refuses the file, exit 2.
    text = filled_template(tmp_path).read_text().replace("\nmax_num_seqs = 12\n", "\nmax_num_seqs = 13\n"
                                                         "cudagraph_capture_sizes = [6, 12, 18, 24, 30, 36, 42, "
                                                         "48, 54, 60, 66, 72, 78]\n", 1)
    path = tmp_path / "uncovered.toml"
    path.write_text(text)
    r = invoke_dspark("config", "check", "--config", str(path))
    assert r.returncode == 2 and "add 65 to it" in r.stderr, (r.returncode, r.stdout, r.stderr)
    r = invoke_dspark("render", "--config", str(path), "--node", "a")
    assert r.returncode == 2 and "add 65 to it" in r.stderr, (r.returncode, r.stderr)


def test_contradicting_settings_are_refused_before_vllm_refuses_them():
    p = checks.check(_cluster(ServingConfig(max_model_len=512)))
    assert any(x.startswith("serving.long_prefill_token_threshold: 1024 is above max_model_len") for x in p)
    p = checks.check(_cluster(ServingConfig(cudagraph_capture_sizes=[6, 12], max_cudagraph_capture_size=36)))
    assert any(x.startswith("serving.max_cudagraph_capture_size: 36 differs") for x in p)
    p = checks.check(_cluster(ServingConfig(cudagraph_capture_sizes=[6, 0])))
    assert any(x.startswith("serving.cudagraph_capture_sizes: must be a whole number in [1,") for x in p), p
    assert any(x.startswith("serving.cudagraph_capture_sizes: must list at least one size")
               for x in checks.check(_cluster(ServingConfig(cudagraph_capture_sizes=[]))))
    with pytest.raises(ConfigError, match="expected a list of whole numbers"):
        C.from_dict({"model": {"path": "/m"}, "serving": {"cudagraph_capture_sizes": ["6"]},
                     "nodes": [{"name": "a", "rank": 0, "address": "10.0.0.1"}]})


# ---------------------------------------------------------------- vLLM 0.28.0's own code


@pytest.fixture(scope="module")
def vllm():
    """vLLM 0.28.0 (the CPU build in .venv), with the modules these tests read imported once:
    importing torch's and vLLM's modules raises deprecation warnings of their own, which are
    not this project's to fix (pytest turns warnings into errors)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vllm = pytest.importorskip("vllm")
        import vllm.config  # noqa: F401,F811 (the submodules, loaded under the same filter)
        import vllm.engine.arg_utils  # noqa: F401
        import vllm.envs  # noqa: F401
        import vllm.utils.argparse_utils  # noqa: F401
        import vllm.v1.worker.gpu.cudagraph_utils  # noqa: F401
    return vllm


def test_vllm_parses_the_rendered_flags_and_knows_the_environment(tmp_path, monkeypatch, vllm):
    from vllm import envs
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cluster = C.load(filled_template(tmp_path))
    launch = render(cluster, cluster.head)
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    # The flags of this item as rendered (stock vLLM has no nvfp4_ds_mla nor flashinfer_b12x:
    # the overlay adds them, so the whole command line is not stock vLLM's to parse).
    f = flags(launch.argv)
    wanted = ["--cudagraph-capture-sizes", "--long-prefill-token-threshold", "--gpu-memory-utilization",
              "--max-num-seqs", "--max-num-batched-tokens"]
    args = parser.parse_args([w for flag in wanted for w in [flag, *f[flag]]])
    assert args.cudagraph_capture_sizes == TEMPLATE_SIZES
    assert args.max_cudagraph_capture_size is None
    assert args.long_prefill_token_threshold == 1024
    assert args.gpu_memory_utilization == 0.835
    # A registered variable (no "Unknown vLLM environment variable"), read as off at "0".
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", launch.env["VLLM_USE_BREAKABLE_CUDAGRAPH"])
    assert envs.environment_variables["VLLM_USE_BREAKABLE_CUDAGRAPH"]() is False


def _vllm_capture_sizes(vllm_args: dict) -> tuple[list[int], object]:
    """The sizes vLLM 0.28.0 captures for the template's scheduler settings and these flags, by
    vLLM's own VllmConfig._set_cudagraph_sizes."""
    from vllm.config import CompilationConfig, VllmConfig

    cfg = SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=False),
        compilation_config=CompilationConfig(**vllm_args),
        scheduler_config=SimpleNamespace(max_num_seqs=12, max_num_batched_tokens=8192),
        parallel_config=SimpleNamespace(tensor_parallel_size=2),
        num_speculative_tokens=K,
        performance_mode="balanced",
    )
    VllmConfig._set_cudagraph_sizes(cfg)
    return cfg.compilation_config.cudagraph_capture_sizes, cfg.compilation_config


def _decode_dispatch(compilation_config) -> dict[int, tuple[str, int]]:
    """requests -> (graph mode, padded rows) through model runner v2's own CudaGraphManager
    (the runner DSpark forces in vLLM 0.28.0), for uniform verify batches of 6 rows a request.
    Its constructor needs the distributed groups and a GPU graph pool, so only the state
    _init_candidates and dispatch read is set."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    m = object.__new__(CudaGraphManager)
    m.vllm_config = SimpleNamespace(speculative_config=None, num_speculative_tokens=K)
    m.compilation_config = compilation_config
    m.max_num_reqs = 12
    m.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    m.decode_query_len = K + 1
    m.varlen_decode = False
    m.lora_capture_cases = [0]
    m._lora_dispatch_map, m._max_lora_case = m._build_lora_dispatch_map()
    m._candidates, m._capture_descs, m.graphs = {}, {}, {}
    m._init_candidates()
    m._graphs_captured = True
    out = {}
    for n in range(1, 13):
        desc = m.dispatch(n, n * (K + 1), K + 1, 0)
        out[n] = (desc.cg_mode.name, desc.num_tokens)
    return out


def test_every_verify_batch_replays_a_full_graph_at_its_own_size(vllm):
    # Before: the seed's --max-cudagraph-capture-size 72 gives vLLM's list 1, 2, 4, 8, ..., 72;
    # 5 and 9 requests (30 and 54 rows) then find no FULL decode graph and run PIECEWISE.
    before_sizes, before = _vllm_capture_sizes({"max_cudagraph_capture_size": 72})
    assert before_sizes == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72]
    got = _decode_dispatch(before)
    assert {n for n, (mode, _) in got.items() if mode != "FULL"} == {5, 9}
    assert got[5] == ("PIECEWISE", 32) and got[9] == ("PIECEWISE", 56)
    assert got[1] == ("FULL", 6)  # one request's 6 rows already had a graph of their own

    # After: the template's sizes; every batch of 1..12 requests replays FULL, unpadded.
    sizes = ServingConfig().capture_sizes
    after_sizes, after = _vllm_capture_sizes({"cudagraph_capture_sizes": sizes})
    assert after_sizes == sizes == TEMPLATE_SIZES and after.max_cudagraph_capture_size == 72
    assert _decode_dispatch(after) == {n: ("FULL", 6 * n) for n in range(1, 13)}
    # dspark's model of this dispatch (what `dspark config check` judges with) says the same.
    for sizes, dispatched in ((before_sizes, got), (after_sizes, _decode_dispatch(after))):
        model = G.coverage(sizes, 12, K, None, "0.28.0")["target"]
        assert {b.reqs: (b.mode, b.padded) for b in model} == dispatched


def test_vllm_turns_breakable_graphs_on_for_deepseek_v4_unless_the_variable_is_set(vllm):
    """vLLM 0.28.0's rule, read where it lives (VllmConfig.__post_init__ needs a whole model to
    run): it sets VLLM_USE_BREAKABLE_CUDAGRAPH=1 for DeepseekV4ForCausalLM only when the
    variable is absent, so the template's explicit 0 is what keeps regular graphs."""
    import inspect

    from vllm.config import VllmConfig

    src = inspect.getsource(VllmConfig.__post_init__)
    rule = re.search(r'"VLLM_USE_BREAKABLE_CUDAGRAPH" not in os\.environ(.*?)'
                     r'os\.environ\["VLLM_USE_BREAKABLE_CUDAGRAPH"\] = "1"', src, re.S)
    assert rule and '"DeepseekV4ForCausalLM"' in rule.group(1)
    assert SEED_ENV["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "0"
