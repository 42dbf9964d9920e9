"""Shape 4 of issue 38 (srt-slurm issue 429: every transfer failed, the benchmark printed "Total
generated tokens: 0" and reported success): a load run with 0 output tokens, transfers
counted with 0 bytes, or every request errored, fails its cell; never a fast pass."""

from typing import Any

from pdsweep.judge.facts import CellFiles
from pdsweep.judge.load import LoadCheck
from pdsweep.judge.transfer import TransferCheck
from pdsweep.results import layout

RUN = {"concurrency": 4, "num_prompts": 16, "completed": 16, "errors": 0, "output_tok_s": 50.0, "output_tokens": 128}
RUN["duration_s"] = 2.56  # vLLM's output_throughput = output_tokens / duration
W = "c/load.json"


def _load(**run: Any) -> list[str]:
    return LoadCheck(required=True).fails(CellFiles("c", {layout.LOAD_FILE: {"runs": [{**RUN, **run}]}}))


def test_a_load_run_with_zero_output_tokens_fails() -> None:
    assert _load() == []
    assert _load(output_tokens=0, output_tok_s=1e9) == [
        f"{W}: runs.0 (concurrency 4): output_tok_s = 1e+09 but output_tokens / duration_s = 0 / 2.56 = 0: "
        "impossible (vLLM output_throughput is output_tokens / duration)",
        f"{W}: concurrency 4: 0 output tokens (output_tokens 0) with every request 'completed': "
        "nothing was generated (a failed run, not a fast one)",
    ]
    # a load.json from before output_tokens: the rate decides
    assert _load(output_tokens=None, output_tok_s=0.0) == [
        f"{W}: concurrency 4: 0 output tokens (output_tok_s 0) with every request 'completed': "
        "nothing was generated (a failed run, not a fast one)"
    ]
    assert _load(output_tokens=None, output_tok_s=None) == [
        f"{W}: concurrency 4: output_tokens and output_tok_s missing (nothing shows output)"
    ]


def test_every_request_errored_fails() -> None:
    assert _load(completed=0, errors=16, output_tokens=0, output_tok_s=0.0) == [
        f"{W}: concurrency 4: 16 load requests failed, completed 0 of num_prompts 16 (vllm bench serve exits 0 regardless)"
    ]


def test_transfers_counted_with_zero_bytes_fail() -> None:
    totals = {
        "num_transfers": 12,
        "bytes": 0,
        "failed_transfers": 0,
        "failed_notifications": 0,
        "expired_reqs": 0,
        "notifications_after_expiry": 0,
        "kv_requests": 12,
    }
    files = CellFiles("c", {layout.TRANSFER_FILE: {"totals": totals}, layout.CELL_FILE: {"cell": {}}})
    assert TransferCheck().fails(files) == [
        "c/transfer.json: no KV transferred (num_transfers 12, bytes 0): decode did not receive KV from prefill"
    ]
