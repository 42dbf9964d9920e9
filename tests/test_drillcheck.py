"""Issue 59 case 5 (pdsweep.run.drillcheck): a drill or workload that cannot act in its cell is
refused by `pdsweep validate` (exit 2, no traceback), with the message `run` would give."""

from __future__ import annotations

from pathlib import Path

import pytest
from _sweepfiles import bad, good

HEAD = "name: x\nplatform: cpu\ndefaults: {max_model_len: 192}\n"
CELL = "matrix: {model: [tiny-llama], tp: [p1d1], block_size: [32], serve_args: [%s], fault: [%s]}\n"
LEASE = "decode-after-lease-expiry"
BENCH = "bench: {enabled: true, check: false, num_prompts: 4, concurrencies: [2]}\n"
VARIANTS = (
    "serve_args:\n  base: []\n"
    "  lease1: {kv_transfer_extra: {kv_connector_extra_config: {kv_lease_duration: 1}}}\n"
    "  lease600: {kv_transfer_extra: {kv_connector_extra_config: {kv_lease_duration: 600}}}\n"
    "  push: {kv_transfer_extra: {kv_connector: NixlPushConnector}}\n"
    "  chunk48: {prefill: ['--max-num-batched-tokens', '48']}\n"
    "  chunk64: {prefill: ['--max-num-batched-tokens', '64']}\n"
)


def sweep(variant: str, fault: str, bench: str = BENCH) -> str:
    return HEAD + VARIANTS + CELL % (variant, fault) + bench


def chunk(variant: str, tokens: int) -> str:
    return sweep(
        variant,
        "none",
        BENCH.replace("concurrencies", f"workloads: [{{name: chunk-boundary, chunk_tokens: {tokens}}}], concurrencies"),
    )


@pytest.mark.parametrize(
    "body, why",
    [
        (
            sweep("base", "kill-decode-during-load", ""),
            "fault kill-decode-during-load kills decode-0 as the bench phase starts, but bench.enabled is false: "
            "the kill would wait for a phase that never comes",
        ),
        (sweep("base", LEASE), f"fault {LEASE} needs a short KV lease: kv_lease_duration is 30 s"),
        (sweep("lease600", LEASE), f"fault {LEASE} needs a short KV lease: kv_lease_duration is 600 s"),
        (sweep("lease1", LEASE, ""), f"fault {LEASE} needs load (bench.enabled)"),
        (
            sweep("push", "fail-read-1-in-4"),
            "fault fail-read-1-in-4 acts on decode's NIXL READs (pull mode), but serve_args push runs "
            "NixlPushConnector: in push mode prefill WRITEs and decode posts no READ",
        ),
        (sweep("push", LEASE), f"fault {LEASE} acts on decode's NIXL READs (pull mode)"),
        (chunk("chunk64", 48), "chunk_tokens 48, but prefill's --max-num-batched-tokens is 64 (serve_args chunk64)"),
        (
            chunk("base", 48),
            "chunk_tokens 48, but prefill's serve args (serve_args base) set no --max-num-batched-tokens",
        ),
        (chunk("chunk48", 200), "chunk_tokens 200 is not below max_model_len 192: no prompt reaches a chunk boundary"),
    ],
    ids=[
        "kill-in-bench-without-bench",
        "lease-default-30s",
        "lease-600s",
        "lease-without-load",
        "fail-read-in-push",
        "lease-in-push",
        "chunk-not-prefills",
        "chunk-flag-missing",
        "chunk-beyond-max-model-len",
    ],
)
def test_a_drill_that_cannot_act_in_its_cell_is_refused_at_validate(
    tmp_path: Path, capsys, body: str, why: str
) -> None:
    err = bad(tmp_path, body, capsys)
    assert why in err and "s.yaml" in err, err


def test_drills_that_can_act_validate(tmp_path: Path, capsys) -> None:
    good(tmp_path, sweep("lease1", LEASE), capsys)
    good(tmp_path, sweep("base", "kill-decode-during-load"), capsys)
    good(tmp_path, chunk("chunk48", 48), capsys)
