"""Which P/D configuration to deploy (pdsweep.judge.pareto, `pdsweep best`): load points per
concurrency from load.json, normalized by the plan's ranks, a failed cell's points off the front,
the best point under an SLO with its runner-up, and refusals of a malformed SLO."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from fixtures.make_runs import case, pd, ref, write_run

from pdsweep.cli import main
from pdsweep.core.errors import UserError
from pdsweep.judge.gate import gate_run
from pdsweep.judge.pareto import Interval, best, describe, front, front_changes, points
from pdsweep.report.pareto_section import front_rows
from pdsweep.results import layout
from pdsweep.sweepfile.phases import BenchSpec
from pdsweep.sweepfile.slo import parse_slo


def run_(conc: int, tok_s: float, ttft_p90: float, tpot_p50: float, goodput: float | None = None) -> dict[str, Any]:
    return {
        "concurrency": conc,
        "num_prompts": 16,
        "completed": 16,
        "errors": 0,
        "output_tok_s": tok_s,
        "duration_s": 10.0,  # vLLM's benchmark duration: every latency fits in it
        "ttft_ms": {"p50": ttft_p90 / 2, "p90": ttft_p90, "p99": ttft_p90 * 1.2},
        "tpot_ms": {"p50": tpot_p50, "p90": tpot_p50 * 1.1, "p99": tpot_p50 * 1.3},
        **({"goodput_req_s": goodput} if goodput is not None else {}),
    }


def load(*runs: dict[str, Any]) -> dict[str, Any]:
    """load.json of ``runs``, each numbered as the repeat it is at its concurrency (0, 1, ...)."""
    seen: dict[int, int] = {}
    numbered = []
    for r in runs:
        numbered.append({**r, "repeat": seen.get(r["concurrency"], 0)})
        seen[r["concurrency"]] = seen.get(r["concurrency"], 0) + 1
    return {layout.LOAD_FILE: {"runs": numbered}}


# run.json bench as run freezes it (a whole BenchSpec, pdsweep.judge.planned.frozen_problems): the pareto runs' load phase
BENCH = BenchSpec(enabled=True, check=False, concurrencies=[1, 4], num_prompts=16, repeats=2).model_dump()
P1D1, P2D1, P1D2 = pd("tiny-llama", 1, 1), pd("tiny-llama", 2, 1), pd("tiny-llama", 1, 2)
REF2 = ref(P1D2).id  # the reference p1d2's load answers were compared with (plan.json references)


def pareto_run(tmp_path: Path, bad: dict[str, Any] | None = None) -> Path:
    """p1d1 (2 ranks), p2d1 (3 ranks) and p1d2 (3 ranks) at concurrency 1 and 4, two repeats each."""
    cases = [
        case(P1D1, load(run_(1, 100, 50, 10), run_(1, 104, 52, 10), run_(4, 300, 120, 13), run_(4, 296, 118, 13))),
        case(P2D1, load(run_(1, 120, 40, 9), run_(1, 126, 41, 9), run_(4, 600, 90, 12), run_(4, 612, 92, 12))),
        case(P1D2, bad or load(run_(1, 90, 60, 11), run_(1, 93, 61, 11), run_(4, 900, 80, 14), run_(4, 905, 81, 14))),
        case(ref(P1D1)),
    ]
    return write_run(tmp_path, "r", cases)


def test_points_are_per_concurrency_per_rank_with_repeat_intervals(tmp_path: Path) -> None:
    run = pareto_run(tmp_path)
    pts = {(p.config, p.concurrency): p for p in points(run, gate_run(run))}
    assert set(pts) == {(c, n) for c in ("p1d1 b16-16", "p2d1 b16-16", "p1d2 b16-16") for n in (1, 4)}
    p = pts[("p2d1 b16-16", 4)]
    assert p.ranks == 3 and p.tok_s_per_gpu.mean == pytest.approx(606 / 3) and p.tok_s_per_gpu.n == 2
    assert p.tok_s_per_gpu.lo is not None and p.tok_s_per_gpu.lo < 606 / 3 < p.tok_s_per_gpu.hi
    assert p.tok_s_per_user == pytest.approx(1000 / 12) and p.latency_ms["ttft_p90"] == pytest.approx(91)


def test_front_leaves_out_dominated_and_failed_points(tmp_path: Path) -> None:
    run = pareto_run(tmp_path)
    pts = points(run, gate_run(run))
    # (tok/s per GPU, tok/s per user): p1d2@4 (301, 71), p2d1@4 (202, 83), p1d1@1 (51, 100), p2d1@1 (41, 111);
    # p1d1@4 (149, 77) is dominated by p2d1@4 and p1d2@1 (31, 91) by p1d1@1
    assert [(p.config, p.concurrency) for p in front(pts)] == [
        ("p1d2 b16-16", 4),
        ("p2d1 b16-16", 4),
        ("p1d1 b16-16", 1),
        ("p2d1 b16-16", 1),
    ]
    # vs TTFT p90 (lower is better): p1d2@4 (81 ms, 301) dominates p2d1@4 (91 ms, 202)
    by_ttft = [(p.config, p.concurrency) for p in front(pts, "ttft_p90")]
    assert by_ttft == [("p1d2 b16-16", 4), ("p1d1 b16-16", 1), ("p2d1 b16-16", 1)]
    # p1d2 serves wrong answers under load: its points are drawn, marked and off the front
    bad = {
        **load(run_(1, 90, 60, 11), run_(4, 900, 80, 8)),
        layout.LOAD_CHECK_FILE: {"verdict": "fail", "reference_cell": REF2, "reasons": ["2 of 16 answers differ"]},
    }
    run2 = pareto_run(tmp_path / "bad", bad)
    pts2 = points(run2, gate_run(run2))
    assert all(p.failed and "answers differ" in p.failed for p in pts2 if p.config.startswith("p1d2"))
    assert [(p.config, p.concurrency) for p in front(pts2)] == [
        ("p2d1 b16-16", 4),
        ("p1d1 b16-16", 1),
        ("p2d1 b16-16", 1),
    ]
    assert best(pts2, parse_slo("ttft_p90=100")).choice.config == "p2d1 b16-16"


def _pair(conc: int, checked: int, wrong: int) -> dict[str, Any]:
    return {"workload": "random", "concurrency": conc, "checked": checked, "wrong": wrong, "stale": 0, "errors": 0,
            "unmatched": 0}  # fmt: skip


def test_each_point_carries_its_own_answer_check(tmp_path: Path) -> None:
    """p1d2 answers right at concurrency 1 and wrong at 4 (load_check.json's pairs): the cell fails
    the gate, its concurrency-4 point is off the front, its concurrency-1 point leads the front."""
    wrong_at_4 = "load workload 'random' at concurrency 4: 3 of 8 answers differ from the reference; first: prompt"
    bad = {
        **load(run_(1, 200, 60, 9), run_(1, 202, 61, 9), run_(4, 900, 80, 14), run_(4, 905, 81, 14)),
        layout.LOAD_CHECK_FILE: {"verdict": "fail", "reference_cell": REF2, "reasons": [wrong_at_4], "workloads": [_pair(1, 8, 0), _pair(4, 8, 3)]},
    }  # fmt: skip
    run = pareto_run(tmp_path, bad)
    g = gate_run(run)
    assert g.cell(P1D2.id).verdict == "FAIL"
    pts = {(p.config, p.concurrency): p for p in points(run, g)}
    one, four = pts[("p1d2 b16-16", 1)], pts[("p1d2 b16-16", 4)]
    assert four.failed == f"FAIL: {P1D2.id}/load_check.json: {wrong_at_4}" and four.answers["wrong"] == 3
    assert one.failed is None and one.answers == {"checked": 8, "wrong": 0, "stale": 0, "errors": 0, "unmatched": 0}
    # p1d2@1 (201 / 3 = 67 tok/s per GPU, 111 tok/s per user) beats p1d1@1 (51, 100) and p2d1@1 (41, 111)
    assert [(p.config, p.concurrency) for p in front(list(pts.values()))] == [("p2d1 b16-16", 4), ("p1d2 b16-16", 1)]
    assert best(list(pts.values()), parse_slo("ttft_p90=70")).choice is one  # p1d2@4 (81 ms) would fail it
    # a reason that names no concurrency (here: a transfer failure) fails every point of the cell
    tr = {"totals": {"failed_transfers": 2}}
    run2 = pareto_run(tmp_path / "tr", {**bad, layout.TRANSFER_FILE: tr})
    assert all(p.failed for p in points(run2, gate_run(run2)) if p.config.startswith("p1d2"))


def test_best_meets_the_slo_and_names_a_runner_up(tmp_path: Path) -> None:
    run = pareto_run(tmp_path)
    pts = points(run, gate_run(run))
    b = best(pts, parse_slo("ttft_p90=100,tpot_p50=12.5"))
    # p1d2@4 misses tpot (14 ms); p2d1@4 (202 tok/s per GPU) leads; the runner-up is another cell's best
    assert (b.choice.config, b.choice.concurrency) == ("p2d1 b16-16", 4)
    assert (b.runner_up.config, b.runner_up.concurrency) == ("p1d1 b16-16", 1)
    assert not b.indistinct  # 202 vs 51 tok/s per GPU, intervals apart
    text = "\n".join(describe(b))
    assert "best: p2d1 b16-16 (fixed) @ concurrency 4: 202 [" in text and "runner-up: p1d1 b16-16" in text
    none = best(pts, parse_slo("ttft_p90=10"))
    assert none.choice is None and none.closest.config == "p2d1 b16-16" and none.closest.concurrency == 1


def test_best_ranks_by_goodput_when_the_run_measured_it(tmp_path: Path) -> None:
    cases = [
        case(P1D1, load(run_(4, 300, 50, 10, goodput=9.0), run_(4, 300, 50, 10, goodput=9.2))),
        case(P2D1, load(run_(4, 900, 50, 10, goodput=3.0), run_(4, 900, 50, 10, goodput=3.1))),
        case(ref(P1D1)),
    ]
    run = write_run(tmp_path, "g", cases)
    b = best(points(run, gate_run(run)), parse_slo("ttft_p90=100"))
    assert b.figure == "goodput_per_gpu" and b.choice.config == "p1d1 b16-16"
    assert b.choice.goodput_per_gpu.mean == pytest.approx(9.1 / 2)


@pytest.mark.parametrize(
    ("slo", "says"),
    [
        ("ttft=500", "'ttft' is not a metric (allowed: ttft_p50, ttft_p90"),
        ("ttft_p90", "ttft_p90 needs a limit in ms > 0"),
        ("ttft_p90=-3", "ttft_p90 needs a limit in ms > 0"),
        ("tpot_p90=nan", "tpot_p90 needs a limit in ms > 0"),
    ],
)
def test_a_malformed_slo_is_refused_naming_the_metric(slo: str, says: str) -> None:
    with pytest.raises(UserError, match=None) as e:
        parse_slo(slo)
    assert says in str(e.value)


def test_best_command_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = pareto_run(tmp_path)
    assert main(["best", str(run), "--slo", "ttft_p90=100"]) == 0
    out = capsys.readouterr().out
    assert "tiny-llama:" in out and "best: p1d2 b16-16 (fixed) @ concurrency 4" in out
    assert main(["best", str(run), "--slo", "ttft_p90=5"]) == 1
    assert "no configuration meets the SLO (ttft_p90 <= 5 ms)" in capsys.readouterr().out
    assert main(["best", str(run), "--slo", "ttfb_p90=5"]) == 2


def test_report_draws_the_front_and_recommends_per_sweep_slo(tmp_path: Path) -> None:
    from pdsweep.report.html import write_report

    run = pareto_run(tmp_path)
    index = layout.read_json(run / layout.RUN_FILE)
    layout.write_json(run / layout.RUN_FILE, {**index, "bench": {**BENCH, "slos": ["ttft_p90=100,tpot_p50=12.5"]}})
    made = write_report(run)
    assert made["front_tiny-llama"].name == "front_tiny-llama.png" and made["front_tiny-llama"].stat().st_size > 10_000
    md = made["markdown"].read_text()
    section = md[md.index("## Which P/D configuration") :]
    assert "| tiny-llama | fixed | p1d2 b16-16 | 4 | 301 [" in section  # the front, best throughput first
    assert (
        "tiny-llama, SLO ttft_p90=100,tpot_p50=12.5:" in section
        and "best: p2d1 b16-16 (fixed) @ concurrency 4" in section
    )
    assert "<h2>Which P/D configuration</h2>" in made["html"].read_text()


def test_front_changes_name_the_points_that_moved_beyond_noise(tmp_path: Path) -> None:
    from pdsweep.judge.pareto import front_changes

    a = pareto_run(tmp_path / "a")
    slow = load(run_(1, 100, 50, 10), run_(1, 104, 52, 10), run_(4, 300, 120, 13), run_(4, 296, 118, 13))
    cases = [
        case(P1D1, slow),
        case(P2D1, load(run_(1, 121, 40, 9), run_(1, 125, 41, 9), run_(4, 300, 90, 12), run_(4, 306, 92, 12))),
        case(
            P1D2,
            {
                **slow,
                layout.LOAD_CHECK_FILE: {
                    "verdict": "fail",
                    "reference_cell": REF2,
                    "reasons": ["2 of 16 answers differ"],
                },
            },
        ),
        case(ref(P1D1)),
    ]
    b = write_run(tmp_path / "b", "r", cases)
    lines = front_changes(points(a, gate_run(a)), points(b, gate_run(b)))
    assert "tiny-llama: p1d2 b16-16 @ concurrency 4: left the front (B: failed)" in lines
    moved = [x for x in lines if x.startswith("tiny-llama: p2d1 b16-16 @ concurrency 4: 202 -> 101 tok/s per GPU")]
    assert moved and "B/A 0.50x" in moved[0]
    assert not any("p2d1 b16-16 @ concurrency 1:" in x for x in lines)  # 123 vs 123: noise, not a move
    assert front_changes(points(a, gate_run(a)), points(a, gate_run(a))) == []


def test_compare_prints_where_the_front_moved(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = pareto_run(tmp_path / "a")
    assert main(["compare", str(a), str(a), "--out", str(tmp_path / "same")]) == 0
    assert "front: no Pareto front moved beyond noise" in capsys.readouterr().out
    bad = load(run_(1, 90, 60, 11), run_(1, 93, 61, 11), run_(4, 900, 80, 14), run_(4, 905, 81, 14))
    b = pareto_run(
        tmp_path / "b",
        {**bad, layout.LOAD_CHECK_FILE: {"verdict": "fail", "reference_cell": REF2, "reasons": ["wrong"]}},
    )
    main(["compare", str(a), str(b), "--out", str(tmp_path / "cmp")])
    assert "front: tiny-llama: p1d2 b16-16 @ concurrency 4: left the front (B: failed)" in capsys.readouterr().out


# machine-load epochs of a shared host, one per pair of interleaved repeats (ABBA), and each run's jitter
EPOCHS, JITTER = (1.0, 2.6, 1.3), (1.01, 0.99, 1.02)


FIXED, UNFIXED = P2D1, pd("tiny-llama", 2, 1, build="unfixed")


def two_builds(root: Path, a: list[float], b: list[float], pairing: bool) -> Path:
    """One run: p2d1 on the fixed build (tok/s ``a`` at concurrency 4) and on the unfixed one (``b``),
    their repeats interleaved (both load.json carry one ``pairing``) or not."""
    sides = [(FIXED, a, "a"), (UNFIXED, b, "b")]
    cases = [
        case(c, {layout.LOAD_FILE: {"runs": load(*[run_(4, v, 90, 12) for v in vs])[layout.LOAD_FILE]["runs"],
                                    **({"pairing": {"id": "pair-1", "side": s}} if pairing else {})}})
        for c, vs, s in sides
    ]  # fmt: skip
    return write_run(root, "r", [*cases, case(ref(FIXED))])


def test_front_changes_use_the_paired_test_where_the_builds_ran_interleaved(tmp_path: Path) -> None:
    """The unfixed build is 20 % slower at p2d1 concurrency 4 under load epochs that move both
    builds' repeats x1 .. x2.6 together: paired (one load.json ``pairing``), the per-pair ratios
    show it; unpaired, Welch's t on the log values cannot tell it from the epochs."""
    a = [600 * e * j for e, j in zip(EPOCHS, JITTER)]
    b = [480 * e / j for e, j in zip(EPOCHS, JITTER)]

    def moved(pairing: bool) -> list[str]:
        pts = points(run := two_builds(tmp_path / str(pairing), a, b, pairing), gate_run(run))
        return front_changes([p for p in pts if p.build == "fixed"], [p for p in pts if p.build == "unfixed"])

    ratio = math.exp(sum(math.log(0.8 / j**2) for j in JITTER) / 3)  # geometric mean of the per-pair ratios
    lines = moved(pairing=True)
    assert len(lines) == 1 and lines[0].startswith(
        f"tiny-llama: p2d1 b16-16 @ concurrency 4: {sum(a) / 9:.3g} -> {sum(b) / 9:.3g} tok/s per GPU (B/A {ratio:.2f}x ["
    ), lines
    assert lines[0].endswith("], paired t-test on per-pair log ratios (repeats interleaved, ABBA), n=3/3)")
    assert moved(pairing=False) == []  # Welch on logs: the epochs drown a 20 % change in 3 repeats


def test_compare_of_one_runs_builds_shows_an_unpaired_front_move_unclaimed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without load epochs Welch sees the 20 % move too; two builds of one run measured unpaired met
    different machine-load epochs minutes apart, so compare shows the move and claims nothing, as
    its perf verdicts do (pdsweep.judge.perf.UNPAIRED_BUILDS); paired, the move is claimed."""
    a, b = [600 * j for j in JITTER], [480 / j for j in JITTER]
    for pairing in (False, True):
        run = two_builds(tmp_path / str(pairing), a, b, pairing)
        main(["compare", str(run), str(run), "--a-build", "fixed", "--b-build", "unfixed", "--out", str(run / "cmp")])
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.startswith("front: tiny-llama: p2d1 b16-16 @ concurrency 4: "))
        test = "paired t-test on per-pair log ratios" if pairing else "Welch t-test on log values (repeats not paired)"
        assert f"{test}" in line and line.endswith(
            "n=3/3)"
            if pairing
            else "n=3/3); not claimed: two builds of one run measured unpaired, minutes apart "
            "(machine-load drift between them is not in the interval; build pairs are measured paired unless "
            "bench.pair_builds: false or a side has no load phase)"
        ), line


def test_intervals_of_rates_stay_positive_on_the_log_scale(tmp_path: Path) -> None:
    """results/cpu-pareto-final (2026-12-07), tiny-llama p1d1 b32 at concurrency 4, 2 repeats: 242.8 and
    190.5 output tok/s, goodput 15.17 and 11.91 req/s (2 ranks). The linear t interval of 2 repeats is
    mean +- 12.7 standard errors: the report printed 108 [-57.8, 274] tok/s per GPU and 6.77 [-3.61, 17.2]
    req/s per GPU. On the log scale: exp(mean log x +- t(0.975, 1) x sem(log x))."""
    tok, good = (242.78347321949883, 190.49243520059935), (15.173967076218677, 11.905777200037459)
    runs = [run_(4, t, 146, 11.8, goodput=g) for t, g in zip(tok, good)]
    run = write_run(tmp_path, "r", [case(P1D1, load(*runs)), case(ref(P1D1))])
    (p,) = points(run, gate_run(run))

    def log_t(xs: tuple[float, float]) -> tuple[float, float]:
        logs = [math.log(x / 2) for x in xs]
        h = 12.706204736174694 * abs(logs[0] - logs[1]) / 2  # t(0.975, 1) x sem of 2 logs
        return math.exp(sum(logs) / 2 - h), math.exp(sum(logs) / 2 + h)

    t, g = p.tok_s_per_gpu, p.goodput_per_gpu
    assert (t.mean, g.mean) == pytest.approx((sum(tok) / 4, sum(good) / 4))  # the mean stays the arithmetic one
    assert (t.lo, t.hi) == pytest.approx(log_t(tok)) and (g.lo, g.hi) == pytest.approx(log_t(good))
    assert (round(t.lo, 1), round(t.hi), round(g.lo, 2), round(g.hi, 1)) == (23.0, 502, 1.44, 31.4)
    assert front_rows([p])[0][4] == "108 [23, 502]"
    assert "best: p1d1 b16-16 (fixed) @ concurrency 4: 6.77 [1.44, 31.4] req/s per GPU (n=2)" in "\n".join(
        describe(best([p], parse_slo("ttft_p90=3000")))
    )
    # a repeat where no request met the SLO (goodput 0): no log; the linear interval, clipped, says so
    zero = Interval.of([0.0, 2.0])
    assert zero is not None and (zero.lo, zero.scale) == (0.0, "clipped")
    assert zero.show("req/s") == "1 [0, 13.7] (lower bound clipped at 0: a repeat measured 0) req/s (n=2)"
