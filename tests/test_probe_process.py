"""The vLLM probe process (pdsweep.builds.attnprobe._Probe) as planning uses it (issue 40 item 3):
started without waiting, queries pipelined and answered in order, the argv check asked in one
query, refusals kept in the answer store, and a probe that cannot start or dies failing closed.
A fake interpreter stands in for the build's python (no vLLM here); tests/test_attnprobe.py and
tests/test_argcheck.py ask the real one."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdsweep.builds import answers, argcheck, attnprobe
from pdsweep.core.errors import UserError
from pdsweep.run import dryrun

# Answers each query line with {"echo": query}; an argv query with one verdict per argv, the
# first refused (one fewer when an argv holds --short); exits on a query holding "die", or at once (no ready line) when DEAD is set.
FAKE = """\
import json, os, sys
if os.environ.get("FAKE_DEAD"): sys.exit(1)
print(json.dumps({"ready": "0.32.0"}), flush=True)
for line in sys.stdin:
    q = json.loads(line)
    if "die" in q: sys.exit(3)
    if q.get("kind") == "argv":
        n = len(q["args"]) - any("--short" in a for a in q["args"])
        out = {"refused": ["vllm serve: error: bad"] + [None] * (n - 1), "parser": "fake"}
    else:
        out = {"echo": q}
    print(json.dumps(out), flush=True)
"""


@pytest.fixture
def fake_python(tmp_path: Path, monkeypatch) -> str:
    """An executable standing for a build's python: runs FAKE whatever ``-c`` script it is given."""
    (tmp_path / "fake.py").write_text(FAKE)
    exe = tmp_path / "python"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'fake.py'}\n")
    exe.chmod(0o755)
    monkeypatch.setenv(answers.CACHE_ENV, str(tmp_path / "store"))
    answers.forget()
    attnprobe.close_probes()
    yield str(exe)
    attnprobe.close_probes()
    answers.forget()


def test_queries_are_pipelined_and_each_gets_its_own_answer(fake_python: str) -> None:
    probe = attnprobe._probe(fake_python)
    first, second = probe.submit({"q": 1}), probe.submit({"q": 2})
    assert probe.result(second) == {"echo": {"q": 2}}  # read past the first answer, which is kept
    assert probe.result(first) == {"echo": {"q": 1}}
    assert probe.ask({"q": 3}) == {"echo": {"q": 3}}
    assert probe.version() == "0.32.0"


def test_every_argv_goes_in_one_query_and_refusals_name_cell_and_instance(fake_python: str, monkeypatch) -> None:
    sent: list[dict] = []
    submit = attnprobe._Probe.submit

    def spy(self, query):
        sent.append(query)
        return submit(self, query)

    monkeypatch.setattr(attnprobe._Probe, "submit", spy)
    items = [("c1", "prefill-0", ["serve", "/m", "--a"]), ("c2", "decode-0", ["serve", "/m", "--b"])]
    wait = argcheck.submit_instances(items, fake_python)
    assert len(sent) == 1 and len(sent[0]["args"]) == 2  # one round trip, sent before waiting
    assert wait() == ["c1 instance prefill-0: vllm serve: error: bad"]
    assert wait() == ["c1 instance prefill-0: vllm serve: error: bad"]  # a second wait reads nothing more


def test_a_probe_that_cannot_start_or_dies_fails_closed(fake_python: str, monkeypatch) -> None:
    probe = attnprobe._probe(fake_python)
    with pytest.raises(UserError, match="the vLLM probe died"):
        probe.ask({"die": True})
    with pytest.raises(UserError, match="the vLLM probe died"):  # and stays dead
        probe.ask({"q": 1})
    attnprobe.close_probes()
    with pytest.raises(UserError, match="the probe gave 1 verdicts for 2"):  # an answer short of verdicts
        argcheck.ask_vllm([["/m", "--x"], ["/m", "--short"]], fake_python)()
    attnprobe.close_probes()
    monkeypatch.setenv("FAKE_DEAD", "1")
    with pytest.raises(UserError, match="cannot import vLLM's CUDA backend selection"):
        argcheck.check_argv(["serve", "/m"], fake_python)


def test_a_refusal_is_an_answer_kept_in_the_store(fake_python: str, monkeypatch) -> None:
    """vLLM's TransferTopology.block_size_ratio refusing (an ``error`` in its answer) is kept,
    so a warm plan asks nothing; only the probe's own failure is asked again."""
    asked: list[dict] = []

    class Refusing:
        def ask(self, q):
            asked.append(q)
            return {"ratio": None, "error": "Local block size 16 is not divisible by remote block size 64"}

    monkeypatch.setattr(attnprobe, "_probe", lambda python: Refusing())
    monkeypatch.setattr(answers, "fingerprint", lambda python: "r" * 16)
    attnprobe._ask.cache_clear()
    got = attnprobe.block_size_ratio(16, 64, python=fake_python)
    answers.forget()  # saved; a new plan process
    attnprobe._ask.cache_clear()
    assert attnprobe.block_size_ratio(16, 64, python=fake_python) == got
    assert got == (None, "Local block size 16 is not divisible by remote block size 64") and len(asked) == 1
    attnprobe._ask.cache_clear()


def test_a_cold_store_starts_the_probe_before_expanding_and_a_warm_one_does_not(fake_python, monkeypatch) -> None:
    started: list[str] = []
    monkeypatch.setattr(attnprobe, "start", lambda python=None: started.append(python))
    monkeypatch.setattr(sys, "executable", fake_python)
    cuda, cpu = (SimpleNamespace(sweep=SimpleNamespace(platform=p)) for p in ("cuda", "cpu"))
    monkeypatch.setattr(answers, "fingerprint", lambda python: "c" * 16)
    answers.forget()
    dryrun.start_probe_if_cold(cpu, check=False)
    assert started == []  # nothing will be asked
    dryrun.start_probe_if_cold(cuda, check=False)
    assert started == [fake_python]
    answers.store("attn", fake_python, attnprobe.SCRIPT).put("k", {"priorities": []})
    dryrun.start_probe_if_cold(cuda, check=False)
    assert started == [fake_python]  # the backend answers are kept
    dryrun.start_probe_if_cold(cuda, check=True)
    assert started == [fake_python] * 2  # the argv verdicts are not
    answers.store("argv", fake_python, attnprobe.SCRIPT).put(json.dumps(["/m"]), {"error": None})
    dryrun.start_probe_if_cold(cuda, check=True)
    assert len(started) == 2


def test_answers_of_another_probe_code_are_not_read(fake_python, monkeypatch) -> None:
    # a mended probe must not read what the old one answered (it kept answers a broken stub spoilt)
    monkeypatch.setattr(answers, "fingerprint", lambda python: "c" * 16)
    answers.store("attn", fake_python, "old probe").put("k", {"priorities": ["X"]})
    answers.forget()
    assert answers.store("attn", fake_python, "old probe").get("k") == {"priorities": ["X"]}
    assert answers.store("attn", fake_python, "new probe").get("k") is None
    assert answers.cold("attn", fake_python, "new probe") and not answers.cold("attn", fake_python, "old probe")
