"""What a sweep may name and override (issue 15, kinds 5 and 6).

Names of models, builds, serve_args and env variants become cell-id parts and directory
names under the run directory, so they are restricted to a safe alphabet and length.
Flags and environment variables that define a cell (its TP, block size, ports, KV
connector) are set by pdsweep from the cell's axes; a variant that set them would run
something other than what the cell id says, so they are refused with the axis to use.
"""

from __future__ import annotations

import re

# letters, digits, '-' and '_' inside; models may also use '.' between such runs
# ("qwen3-0.6b"); nothing else (no '/', '..', spaces, newlines)
NAME = re.compile(r"^[A-Za-z0-9]+(?:[-_][A-Za-z0-9]+)*$")
MODEL_NAME = re.compile(r"^[A-Za-z0-9]+(?:[-_.][A-Za-z0-9]+)*$")
MAX_NAME = 40
MAX_MODEL_NAME = 64
# optional cell-id parts (pdsweep.plan.expand.Cell.id): a serve_args variant named like one would
# make two different cells share an id
ID_PART = re.compile(r"^(?:p\d+d\d+|b\d+(?:-\d+)?|ref-tp\d+|\d+x\d+|ddp\d+|ppp\d+|layout-.*|kvbuf-.*|env-.*)$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# vllm serve flags pdsweep derives (pdsweep.plan.instance.instances), with the axis/setting instead
_TP = "the tp axis (or prefill_tp/decode_tp)"
_PP = (
    "the prefill_pp axis (prefill pipeline stages; vLLM 0.32.0 refuses PP on the decode: "
    '"NixlPushConnector consumer (decode) does not support pipeline_parallel_size > 1.", '
    "nixl/base_worker.py NixlBaseConnectorWorker.__init__)"
)
RESERVED_FLAGS = {
    "--tensor-parallel-size": _TP,
    "-tp": _TP,
    "--data-parallel-size": "the decode_dp axis",
    "-dp": "the decode_dp axis",
    "--data-parallel-size-local": "the decode_dp axis",
    "--block-size": "the block_size axis (or prefill_block_size/decode_block_size)",
    "--port": "defaults.port_base (pdsweep gives each cell a private block of ports)",
    "--host": "nothing: pdsweep serves on 127.0.0.1 behind its PD proxy",
    "--kv-transfer-config": (
        "the kv_buffer_device axis, defaults.kv_role, defaults.kv_lease_duration_s and "
        "serve_args.<variant>.kv_transfer_extra (connector and role cannot change)"
    ),
    "--served-model-name": "nothing: the proxy and lm-eval address the model by its catalogue name",
    "--config": "serve_args lists (a --config file could set any flag above)",
    "--pipeline-parallel-size": _PP,
    "-pp": _PP,
}
# vllm serve flags pdsweep refuses outright: every flag that binds a port or socket pdsweep does
# not allocate (two concurrent cells would share it). pdsweep allocates --port, VLLM_PORT and
# VLLM_NIXL_SIDE_CHANNEL_PORT per cell.
_PORT = (
    "binds a port pdsweep does not allocate, which concurrent cells would share; pdsweep "
    "allocates only --port, VLLM_PORT and VLLM_NIXL_SIDE_CHANNEL_PORT per cell"
)
REFUSED_FLAGS = {
    "--grpc": "serves gRPC on --port instead of the HTTP OpenAI API pdsweep's proxy, probes and lm-eval speak",
    "--kv-events-config": f"its publisher endpoint (e.g. tcp://*:5557) {_PORT}",
    "--grpc-port": _PORT,
    "--data-parallel-rpc-port": _PORT,
    "-dpp": _PORT,
    "--data-parallel-supervisor-port": _PORT,
    "--master-port": _PORT,
    "--uds": "serves on a unix socket instead of the --port pdsweep's proxy, probes and lm-eval use",
}
RESERVED_ENV = {
    "VLLM_PORT": "defaults.port_base (pdsweep gives each cell a private block of ports)",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "defaults.port_base (pdsweep gives each cell a private block of ports)",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "nothing: every instance of a cell runs on this host",
    "VLLM_KV_CACHE_LAYOUT": "the kv_cache_layout axis (decode's layout; pdsweep.plan.instance.derived_env)",
    "VLLM_SSM_CONV_STATE_LAYOUT": "nothing: derived for SSM models (pdsweep.plan.instance.derived_env)",
    "CUDA_VISIBLE_DEVICES": "--gpus and the scheduler (pdsweep hands each cell its GPUs)",
    "PDSWEEP_KV_DIGEST_SAMPLE": "integrity.gpu_sample (the fraction of requests whose KV is digested on GPU)",
    # "0" here switched a CPU cell's digests off and with them the gate's integrity check (pdsweep.judge.integrity)
    "PDSWEEP_KV_DIGEST": "integrity.gpu (the plan digests every PD cell's KV on CPU, on GPU where the sweep opts in)",
}


def unsafe_name(name: object, model: bool = False) -> str | None:
    """Why ``name`` cannot be a model (``model=True``) or build/variant name, or None."""
    limit, rx = (MAX_MODEL_NAME, MODEL_NAME) if model else (MAX_NAME, NAME)
    allowed = "letters, digits, '-', '_'" + (" and '.'" if model else "")
    if not isinstance(name, str) or not rx.fullmatch(name) or len(name) > limit:
        return (
            f"name {name!r} is not safe: it becomes a cell-id part and a directory name; use {allowed}, "
            f"starting and ending with a letter or digit, at most {limit} characters"
        )
    if not model and ID_PART.fullmatch(name):
        parts = "pPdD, bN-M, NxM, ddpN, pppN, layout-, kvbuf-, env-"
        return f"name {name!r} looks like a cell-id part ({parts}): ids would be ambiguous"
    return None


def flag_key(arg: str) -> str | None:
    """The option an argv item sets as vLLM's FlexibleArgumentParser reads it
    (vllm/utils/argparse_utils.py ``parse_args``: ``_`` -> ``-`` in the name,
    ``--json-arg.key value`` sets a key of ``--json-arg``), or None for a value."""
    if arg.startswith("--"):
        return "--" + arg[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")
    m = re.match(r"^-(tp|dpp|dp|pp)(?:=|\d|$)", arg)
    return f"-{m.group(1)}" if m else None


def reserved_flag(arg: str) -> str | None:
    """``"--flag: use X"`` when ``arg`` sets a flag pdsweep derives, or an abbreviation of
    one (argparse accepts unique prefixes), else None."""
    key = flag_key(arg)
    if key is None:
        return None
    for flag, instead in RESERVED_FLAGS.items():
        if key == flag or (flag.startswith("--") and len(key) > 3 and flag.startswith(key)):
            return f"{arg!r} sets {flag}, which defines the cell (its id would lie): use {instead}"
    if key in REFUSED_FLAGS:  # full names only (abbreviations of these: not caught)
        return f"{arg!r} sets {key}, which pdsweep refuses: {REFUSED_FLAGS[key]}"
    return None


def reserved_env(var: str) -> str | None:
    """``"VAR: use X"`` when ``var`` is an environment variable pdsweep derives, else None."""
    if not ENV_NAME.fullmatch(var):
        return f"{var!r} is not an environment variable name (letters, digits, '_'; not starting with a digit)"
    if var in RESERVED_ENV:
        return f"{var} is set by pdsweep and defines the cell: use {RESERVED_ENV[var]}"
    return None
