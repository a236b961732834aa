"""The systemd units' names and paths, declared once: the unit files, the service user, the
drop-ins, the sysusers entry and the cache directories the units give vLLM. Read by the
rendering (`unit_render`), the installing (`unit_install`), the host check (`preflight`) and
the tests; of dspark it imports only the cluster file's default path."""

from __future__ import annotations

from dspark.config.schema import DEFAULT_CONFIG_PATH

HEAD = "dspark-head.service"
WORKER = "dspark-worker.service"
WORKER_TEMPLATE = "dspark-worker@.service"
READY_TARGET = "dspark-worker-ready.target"
WAIT_WORKER = "dspark-wait-worker.service"
DASHBOARD = "dspark-dashboard.service"
UNIT_NAMES = (WORKER, WORKER_TEMPLATE, HEAD, READY_TARGET, WAIT_WORKER, DASHBOARD)

USER = "dspark"
DEFAULT_CONFIG = str(DEFAULT_CONFIG_PATH)  # the cluster file the units name (config_schema's default)
SYSTEM_UNIT_DIR = "etc/systemd/system"
SYSUSERS_FILE = "etc/sysusers.d/dspark.conf"
NODE_DROPIN = "50-dspark-node.conf"
# Named for the local pair it began with; written on every host that runs several nodes.
LOCAL_PAIR_DROPIN = "60-dspark-local-pair.conf"
# Characters a node name may have to name a dspark-worker@ instance as it is, and to be its
# state directory: a unit name's own, less the backslash of systemd's escapes.
INSTANCE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:_.-")

# Persistent JIT caches: a kernel compiled once (Triton, FlashInfer, CUTLASS DSL, torch.compile,
# CUDA's PTX JIT) is reused after a restart instead of compiling in the middle of serving,
# which has killed pairs before. All of them live under CacheDirectory=dspark.
CACHE_ENV = (
    ("XDG_CACHE_HOME", "%C/dspark"),
    ("VLLM_CACHE_ROOT", "%C/dspark/vllm"),  # torch.compile artifacts (torch_compile_cache)
    ("TORCHINDUCTOR_CACHE_DIR", "%C/dspark/torchinductor"),
    ("TRITON_CACHE_DIR", "%C/dspark/triton"),
    ("FLASHINFER_WORKSPACE_BASE", "%C/dspark/flashinfer"),
    ("CUTE_DSL_CACHE_DIR", "%C/dspark/cutlass-dsl"),
    ("TORCH_EXTENSIONS_DIR", "%C/dspark/torch-extensions"),
    ("CUDA_CACHE_PATH", "%C/dspark/cuda"),
    ("CUDA_CACHE_MAXSIZE", "4294967296"),  # CUDA's default (256 MiB) evicts a DeepSeek build's kernels
)
