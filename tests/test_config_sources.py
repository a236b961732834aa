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

from dspark_cli import invoke_dspark
from dspark import config as C
from dspark.render import render

K = 5  # DSpark's speculative tokens in the template: 6 verify rows per request
MULTIPLES_OF_6 = list(range(6, 73, 6))


def filled_template(tmp_path):
    text = (C.template().replace('"/var/lib/dspark/models/CHANGEME"', '"/models/dsv4"')
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
    fields = {f.name: f for f in dataclasses.fields(C.ServingConfig)}
    assert all(f.metadata.get("source") for f in fields.values()), \
        [n for n, f in fields.items() if not f.metadata.get("source")]
    serving = C.template().split("[serving]\n", 1)[1].split("\n\n", 1)[0].splitlines()
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
    text = C.template()
    head = text.split("[model]", 1)[0]
    assert "shm_broadcast" in head and "MiaAI-Lab PR #71" in head and "no setting" in head
    # The capture sizes follow max_num_seqs and the speculative tokens: shown, not written.
    shown = "# cudagraph_capture_sizes = [6, 12, 18, 24, 30, 36, 42, 48, 54, 60, 66, 72]  (unset: "
    assert shown in text.split("[serving]", 1)[1].split("[supervisor]", 1)[0]


def test_rendered_template_carries_the_gb10_defaults(tmp_path):
    """Through `dspark render`, as an operator sees it, and through render() for the argv."""
    path = filled_template(tmp_path)
    r = invoke_dspark("render", "--config", str(path), "--node", "a")
    assert r.returncode == 0, r.stderr
    assert "VLLM_USE_BREAKABLE_CUDAGRAPH=0 \\\n" in r.stdout
    assert "--long-prefill-token-threshold 1024 \\\n" in r.stdout
    assert "--gpu-memory-utilization 0.835 \\\n" in r.stdout
    assert "--cudagraph-capture-sizes 6 12 18 24 30 36 42 48 54 60 66 72 \\\n" in r.stdout

    cluster = C.load(path)
    for node in cluster.nodes:
        launch = render(cluster, node)
        f = flags(launch.argv)
        assert f["--cudagraph-capture-sizes"] == [str(n) for n in MULTIPLES_OF_6]
        assert "--max-cudagraph-capture-size" not in f  # vLLM takes the largest size as the maximum
        assert f["--long-prefill-token-threshold"] == ["1024"]
        assert f["--gpu-memory-utilization"] == ["0.835"]
        assert launch.env["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "0"


def test_capture_sizes_follow_the_verify_rows_and_the_operator():
    s = C.ServingConfig()
    assert s.capture_sizes == MULTIPLES_OF_6
    assert C.ServingConfig(max_num_seqs=6).capture_sizes == list(range(6, 37, 6))
    assert C.ServingConfig(max_cudagraph_capture_size=36).capture_sizes == list(range(6, 37, 6))
    assert C.ServingConfig(cudagraph_capture_sizes=[12, 6, 6]).capture_sizes == [6, 12]
    # Without speculative decoding vLLM's own list is left alone.
    plain = C.ServingConfig(speculative_config=None)
    assert plain.capture_sizes is None
    assert flags(render(_cluster(plain), _cluster(plain).head).argv)["--max-cudagraph-capture-size"] == ["12"]


def _cluster(serving: C.ServingConfig) -> C.Cluster:
    return C.Cluster(model=C.ModelConfig(path="/m"), serving=serving,
                     nodes=(C.NodeConfig(name="a", rank=0, address="10.0.0.1"),
                            C.NodeConfig(name="b", rank=1, address="10.0.0.2")))


def test_contradicting_settings_are_refused_before_vllm_refuses_them():
    p = C.check(_cluster(C.ServingConfig(max_model_len=512)))
    assert any(x.startswith("serving.long_prefill_token_threshold: 1024 is above max_model_len") for x in p)
    p = C.check(_cluster(C.ServingConfig(cudagraph_capture_sizes=[6, 12], max_cudagraph_capture_size=36)))
    assert any(x.startswith("serving.max_cudagraph_capture_size: 36 differs") for x in p)
    p = C.check(_cluster(C.ServingConfig(cudagraph_capture_sizes=[6, 0])))
    assert any(x.startswith("serving.cudagraph_capture_sizes: must be a whole number in [1,") for x in p), p
    assert any(x.startswith("serving.cudagraph_capture_sizes: must list at least one size")
               for x in C.check(_cluster(C.ServingConfig(cudagraph_capture_sizes=[]))))
    with pytest.raises(C.ConfigError, match="expected a list of whole numbers"):
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
    assert args.cudagraph_capture_sizes == MULTIPLES_OF_6
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
    sizes = C.ServingConfig().capture_sizes
    after_sizes, after = _vllm_capture_sizes({"cudagraph_capture_sizes": sizes})
    assert after_sizes == sizes == MULTIPLES_OF_6 and after.max_cudagraph_capture_size == 72
    assert _decode_dispatch(after) == {n: ("FULL", 6 * n) for n in range(1, 13)}


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
    assert C.SEED_ENV["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "0"
