"""Faults, one vocabulary: every fault pdsweep injects, where it acts, its knobs and the failure
the gate must then report. The drill (:mod:`pdsweep.run.drills`), the PD proxy
(:mod:`pdsweep.deploy.proxy_faults`), the engine plugin (:mod:`pdsweep.engine.vllm_plugin`,
:mod:`pdsweep.engine.readfault`) and the sweep schema (``fault:`` axis, :mod:`pdsweep.sweepfile.sweep`)
read their names and knobs from here; ``core`` so that every layer may import it (the engine
plugin runs inside vLLM and imports nothing above ``core``).

Where a fault acts (:data:`WHERE`):

- ``drill``: pdsweep's run loop SIGKILLs an instance as a phase begins (the launcher's process);
- ``proxy``: the PD proxy changes or delays the decode leg (:class:`ProxyFaults`);
- ``engine``: pdsweep's vLLM plugin inside decode's worker reports NIXL READs as failed, or
  posts them late (:data:`ENGINE_OPTIONS`);
- ``fake``: the fake vLLM of the tests (``tests/fake_vllm.py``) misbehaves as an engine would,
  switched by an env knob (:data:`FAKE_FAULTS`); pdsweep never sets these.

Two families: **sweep faults** are values of a sweep's ``fault`` axis (:data:`SWEEP_FAULTS`; a
cell declares the failure with ``expect: fail`` + ``match:``); **proxy options** are the run's
test-only switches (:data:`PROXY_OPTIONS`, ``pdsweep run --scramble-every`` ...), used by tests
and benches to show a gate has teeth; **engine options** (:data:`ENGINE_OPTIONS`) are env knobs
of pdsweep's vLLM plugin with the same purpose (the KV-transfer slowdown of
``bench/test_perf_teeth.py``); **fake faults** (:data:`FAKE_FAULTS`) are the fake vLLM's
env knobs, which tests set in a sweep's ``env:`` variant (``tests/test_run_fake.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Where = Literal["drill", "proxy", "engine", "fake"]
WHERE: tuple[Where, ...] = ("drill", "proxy", "engine", "fake")


@dataclass(frozen=True)
class FaultKind:
    """One fault: ``name`` (the sweep's ``fault:`` value, a run option's name, or a pattern for
    ``fail-read-1-in-K``), ``where`` it acts, ``knobs`` (what switches it on, in words),
    ``expects`` (the failure the gate must report, in words or as the sweeps' ``match:``
    regex) and for a kill ``phase``/``target`` (the phase as ``on_phase`` names it, the instance)."""

    name: str
    where: Where
    knobs: str
    expects: str
    phase: str | None = None
    target: str | None = None


NONE = "none"
KILL_PREFILL_DURING_EVAL = "kill-prefill-during-eval"
KILL_DECODE_DURING_LOAD = "kill-decode-during-load"
LEASE_EXPIRY = "decode-after-lease-expiry"
# the lease drill holding 1 in K decode legs (default LEASE_DELAY_EVERY): the fewer held, the more requests keep
# prefill allocating while one is held (a closed-loop client whose every slot waits on a held leg sends nothing)
LEASE_EVERY_PATTERN = r"^decode-after-lease-expiry(?:-1-in-([2-9]|[1-9][0-9]))?$"
LEASE_DELAY_EVERY = 4
READ_FAULT_PATTERN = r"^fail-read-1-in-([1-9][0-9]{0,5})$"
READ_FAULT_ENV_VAR = "PDSWEEP_FAIL_READ_EVERY"  # set on decode instances; read by the engine plugin
READ_FAULT_MAX = 999_999
FLIP_BYTE_PATTERN = r"^flip-byte-1-in-([1-9][0-9]{0,5})$"
SCRAMBLE_PATTERN = r"^scramble-kv-1-in-([1-9][0-9]{0,5})$"  # the proxy's scramble_every, as a cell's fault
FLIP_BYTE_ENV_VAR = "PDSWEEP_FLIP_BYTE_EVERY"  # set on decode instances; read by pdsweep.engine.kvdigest
KV_DIGEST_ENV_VAR = "PDSWEEP_KV_DIGEST"  # PD instances on CPU: pdsweep.engine.kvdigest, transfer.json integrity
# test-only: decode posts each NIXL READ this many ms late, inside its timed interval (pdsweep.engine.readdelay)
READ_DELAY_ENV_VAR = "PDSWEEP_READ_DELAY_MS"

SWEEP_FAULTS: dict[str, FaultKind] = {
    KILL_PREFILL_DURING_EVAL: FaultKind(
        KILL_PREFILL_DURING_EVAL,
        "drill",
        "SIGKILL to prefill-0 1 s into the eval phase (pdsweep.run.drills.KILL_AFTER_S)",
        r"prefill-0 \(pid \d+\) killed by signal 9 \(SIGKILL\) during eval; ",
        phase="eval",
        target="prefill-0",
    ),
    KILL_DECODE_DURING_LOAD: FaultKind(
        KILL_DECODE_DURING_LOAD,
        "drill",
        "SIGKILL to decode-0 1 s into the load phase (vllm bench serve)",
        r"decode-0 \(pid \d+\) killed by signal 9 \(SIGKILL\) during bench; ",
        phase="bench",
        target="decode-0",
    ),
    LEASE_EXPIRY: FaultKind(
        LEASE_EXPIRY,
        "proxy",
        "ProxyFaults.decode_delay_s = KV lease + 5 s on 1 in 4 decode legs (1 in K: decode-after-lease-expiry-1-in-K, "
        "K in 2..99; pdsweep.run.drills.lease_drill_faults)",
        "transfer.json totals.notifications_after_expiry > 0 and load answers that differ from the reference",
    ),
    "fail-read-1-in-K": FaultKind(
        READ_FAULT_PATTERN,
        "engine",
        f"{READ_FAULT_ENV_VAR}=K on decode: every K-th NIXL READ done is reported ERR (pdsweep.engine.readfault)",
        "kv_load_failure_policy recompute: none (vLLM's failed-transfer count equals the injected one); "
        r"fail: 'failed \d+ request\(s\) after a KV load failure'",
    ),
    "flip-byte-1-in-N": FaultKind(
        FLIP_BYTE_PATTERN,
        "engine",
        f"{FLIP_BYTE_ENV_VAR}=N on decode: every N-th NIXL READ done (push: every N-th request whose WRITEs "
        "were all notified) has one byte of its first block inverted in decode's KV cache after the transfer "
        "(pdsweep.engine.kvdigest, pdsweep.engine.kvpushdigest)",
        r"integrity: \d+ mismatched block\(s\) of \d+; first: request \S+ group \S+ prefill rank \d+ block \d+",
    ),
    "scramble-kv-1-in-K": FaultKind(
        SCRAMBLE_PATTERN,
        "proxy",
        "ProxyFaults.scramble_every = K: the PD proxy reverses remote_block_ids in 1 in K decode legs that arrive "
        "while another request is in flight (pdsweep.run.drills.lease_drill_faults); concurrency 1 is spared",
        r"load_check.json: 'concurrency 2+: \d+ of \d+ answers differ from the reference; first: prompt'",
    ),
}

# the scrambled-KV drill (``scramble_kv_block_ids``: every decode leg's remote_block_ids reversed) fails on
# answers (the consistency probe) and on integrity: decode's READs carry prefill's bytes in another order,
# so the digests name the first block whose position decode filled from another (pdsweep.core.kvintegrity)
SCRAMBLE_KV_MATCH = (
    r"(?s)^(?=.*consistency\.json)(?=.*integrity: \d+ mismatched block\(s\) of \d+; first: request \S+ "
    r"group \d+:\S+ prefill rank \d+ block \d+ .*; \d+ misplaced: decode filled request \S+ group \d+:\S+ "
    r"prefill rank \d+ block \d+'s position \d+ with prefill block \d+)"
)

PROXY_OPTIONS: dict[str, FaultKind] = {
    k.name: k
    for k in (
        FaultKind("drop_kv_transfer_params", "proxy", "decode leg without the prefill's handle", "transfer gate"),
        FaultKind("scramble_kv_block_ids", "proxy", "every handle's block ids reversed", SCRAMBLE_KV_MATCH),
        FaultKind("scramble_every", "proxy", "1 in k requests under concurrency scrambled", "load check"),
        FaultKind("stale_kv_transfer_params", "proxy", "the previous request's handle, if it covers", "load: stale"),
        FaultKind("decode_delay_s", "proxy", "sleep before 1 in decode_delay_every decode legs", "perf verdict"),
    )
}

# name (the env knob) -> what pdsweep's vLLM plugin does; test-only, never set by pdsweep (bench/test_perf_teeth.py)
ENGINE_OPTIONS: dict[str, FaultKind] = {
    READ_DELAY_ENV_VAR: FaultKind(
        READ_DELAY_ENV_VAR,
        "engine",
        f"{READ_DELAY_ENV_VAR}=MS, or =@FILE holding MS (read at each READ), on decode with the READ log: "
        "each NIXL READ is posted MS later, inside its timed interval (pdsweep.engine.readdelay)",
        "perf verdict: kv kv_xfer_ms regression",
    ),
}

# name (the env knob) -> what the fake does, and the failure pdsweep must report (tests/test_run_fake.py)
FAKE_FAULTS: dict[str, FaultKind] = {
    k.name: k
    for k in (
        FaultKind(
            "FAKE_EXIT_AT_STARTUP", "fake", "exit with this code during startup", "exited with code N during startup"
        ),
        FaultKind("FAKE_DIE_AFTER", "fake", "hard-exit after N completions", "the cell fails in its phase, no hang"),
        FaultKind(
            "FAKE_SIGKILL_AFTER", "fake", "SIGKILL after N completions (FAKE_SIGKILL_ROLE)", "killed by signal 9"
        ),
        FaultKind("FAKE_FAILED_XFERS", "fake", "N more vllm:nixl_num_failed_transfers per PD request", "transfer gate"),
        FaultKind("FAKE_WRONG_EVERY", "fake", "every Nth arithmetic answer wrong", "accuracy gate"),
        FaultKind("FAKE_DIVERGE", "fake", "decode shifts its first token (lost KV shape)", "consistency probe"),
        FaultKind("FAKE_EXPIRED", "fake", "N more vllm:nixl_num_kv_expired_reqs per PD request", "totals.expired_reqs"),
        FaultKind("FAKE_SKIP_XFER_EVERY", "fake", "every Nth PD request without a transfer", "silent recompute"),
        FaultKind("FAKE_STREAM_HANG", "fake", "a streaming request never sends a chunk", "streaming request ..."),
        FaultKind("FAKE_HANG_AFTER", "fake", "completions after N never answer", "lm-eval exceeded its budget"),
        FaultKind("FAKE_HANG_ONCE_FILE", "fake", "the first completion never answers, once", "one redeploy"),
        FaultKind(
            "FAKE_BLOCK_SIZE", "fake", "reports this block size (cache_config_info), not --block-size", "block_mismatch"
        ),
        FaultKind("FAKE_BENCH_LOST", "fake", "vllm bench serve drops N requests as failed", "load gate"),
        FaultKind("FAKE_BENCH_HANG", "fake", "vllm bench serve hangs", "vllm bench serve exceeded its budget"),
    )
}


def read_fault_every(fault: str | None) -> int | None:
    """K of a ``fail-read-1-in-K`` fault (1 <= K <= 999999), else None."""
    m = re.match(READ_FAULT_PATTERN, fault or "")
    return int(m.group(1)) if m else None


def flip_byte_every(fault: str | None) -> int | None:
    """N of a ``flip-byte-1-in-N`` fault (1 <= N <= 999999), else None."""
    m = re.match(FLIP_BYTE_PATTERN, fault or "")
    return int(m.group(1)) if m else None


def scramble_kv_every(fault: str | None) -> int | None:
    """K of a ``scramble-kv-1-in-K`` fault (1 <= K <= 999999), else None."""
    m = re.match(SCRAMBLE_PATTERN, fault or "")
    return int(m.group(1)) if m else None


def lease_drill_every(fault: str | None) -> int | None:
    """K of the lease drill's 1 in K held decode legs: :data:`LEASE_DELAY_EVERY` for
    ``decode-after-lease-expiry``, K for ``decode-after-lease-expiry-1-in-K`` (2 <= K <= 99), else None."""
    m = re.match(LEASE_EVERY_PATTERN, fault or "")
    return None if m is None else int(m.group(1) or LEASE_DELAY_EVERY)


def sweep_fault(name: str) -> FaultKind | None:
    """The :class:`FaultKind` of a sweep's ``fault:`` value; None for ``none``. Raises ValueError
    naming the allowed values for any other name."""
    if name == NONE:
        return None
    if read_fault_every(name):
        return SWEEP_FAULTS["fail-read-1-in-K"]
    if flip_byte_every(name):
        return SWEEP_FAULTS["flip-byte-1-in-N"]
    if scramble_kv_every(name):
        return SWEEP_FAULTS["scramble-kv-1-in-K"]
    if lease_drill_every(name):
        return SWEEP_FAULTS[LEASE_EXPIRY]
    if name in SWEEP_FAULTS:
        return SWEEP_FAULTS[name]
    patterns = ("fail-read-1-in-K", "flip-byte-1-in-N", "scramble-kv-1-in-K")
    allowed = ", ".join([NONE, *(k for k in SWEEP_FAULTS if k not in patterns), f"{LEASE_EXPIRY}-1-in-K", *patterns])
    raise ValueError(f"unknown fault {name!r} (allowed: {allowed}; K, N in 1..{READ_FAULT_MAX}; lease K in 2..99)")


def check_sweep_fault(name: str) -> str:
    """``name`` if it is a sweep fault (:func:`sweep_fault`), else ValueError: the schema's validator."""
    sweep_fault(name)
    return name


@dataclass(frozen=True)
class ProxyFaults:
    """The knobs of the PD proxy's faults (where ``proxy``): :data:`PROXY_OPTIONS` plus
    ``decode_delay_every``; injected into decode legs by
    :class:`pdsweep.deploy.proxy_faults.FaultInjector`, each one counted in
    ``pdsweep_proxy_faults_total{fault}``.

    ``drop_kv_transfer_params``: the decode leg goes without the prefill's handle, so decode
    recomputes the prompt (the transfer gate must catch it); ``scramble_kv_block_ids``: every
    handle's block ids reversed, KV arrives wrong (the consistency probe must);
    ``scramble_every`` k: 1 in k requests arriving while another is in flight (the load check
    must); ``stale_kv_transfer_params``: decode gets the previous request's handle (the
    ``stale`` check must); ``decode_delay_s``: sleep before each decode leg, a controlled TTFT
    and E2E slowdown (bench/test_perf_teeth.py), or, with ``decode_delay_every`` k > 1, before
    1 in k decode legs (the 1st, the (k+1)th, ...: the ``decode-after-lease-expiry`` drill).
    Raises ValueError for ``scramble_every < 0``, ``decode_delay_s < 0`` or ``decode_delay_every < 1``.
    """

    drop_kv_transfer_params: bool = False
    scramble_kv_block_ids: bool = False
    scramble_every: int = 0
    stale_kv_transfer_params: bool = False
    decode_delay_s: float = 0.0
    decode_delay_every: int = 1

    def __post_init__(self) -> None:
        if not self.scramble_every >= 0:
            raise ValueError(f"scramble_every must be >= 0, got {self.scramble_every}")
        if not self.decode_delay_s >= 0:
            raise ValueError(f"decode_delay_s must be >= 0, got {self.decode_delay_s}")
        if not self.decode_delay_every >= 1:
            raise ValueError(f"decode_delay_every must be >= 1, got {self.decode_delay_every}")

    @property
    def active(self) -> bool:
        """Whether any fault is on (off: the proxy's hot path skips fault handling entirely)."""
        return self != NO_PROXY_FAULTS

    def describe(self) -> str:
        """The proxy's start-up log suffix naming the fault that is on ("" when none)."""
        if self.drop_kv_transfer_params:
            return ", DROPPING kv_transfer_params"
        if self.scramble_kv_block_ids:
            return ", SCRAMBLING remote_block_ids"
        if self.scramble_every:
            return f", SCRAMBLING 1 in {self.scramble_every} requests under load"
        if self.stale_kv_transfer_params:
            return ", STALE kv_transfer_params (the previous request's)"
        if self.decode_delay_s:
            return f", DELAYING 1 in {self.decode_delay_every} decode legs by {self.decode_delay_s:g} s"
        return ""


NO_PROXY_FAULTS = ProxyFaults()  # the default: a real deployment
