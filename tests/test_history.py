"""The history store, sustained-change detection with the build difference, `pdsweep
history` / `pdsweep dashboard`, and the dashboard rendered in headless Chromium."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest
from _chromium import console_errors, need_chromium, render
from fixtures.make_runs import crashed, pd, ref, write_run

from pdsweep.cli import main
from pdsweep.core.errors import UserError
from pdsweep.history import store, trends
from pdsweep.history.text import run_news
from pdsweep.results import layout

CELL = pd("tiny-llama", 1, 1)
CID = CELL.id


def nightly(root: Path, i: int, gbps: float, vllm: str = "0.27.0", fail: bool = False) -> Path:
    """Run ``night-<i>`` of sweep ``nightly``: the PD cell at ``gbps`` (its reference
    beside it), started on day ``i``, the cell built with vLLM ``vllm``."""
    patch = crashed("eval", "decode-0 died", []) if fail else {}
    cases = [
        (CELL, {"good": {"gbps": gbps}, "patch": {layout.CELL_FILE: {"build": {"vllm_version": vllm}}, **patch}}),
        (ref(CELL), {}),
    ]
    run = write_run(root, f"night-{i:02d}", cases, sweep_name="nightly")
    index = layout.read_json(run / layout.RUN_FILE)
    index["started"] = f"2026-06-{i:02d}T02:00:00+00:00"
    layout.write_json(run / layout.RUN_FILE, index)
    return run


def history(tmp_path: Path, gbps: list[float], **kw: dict[int, object]) -> Path:
    db = tmp_path / "h.sqlite"
    for i, g in enumerate(gbps, 1):
        extra = {k: v[i] for k, v in kw.items() if i in v}
        store.add_run(db, nightly(tmp_path / "runs", i, g, **extra))  # type: ignore[arg-type]
    return db


def changes(db: Path, metric: str) -> list[trends.Change]:
    with store.connect(db, create=False) as conn:
        if metric == "verdict":
            return trends.verdict_changes(CID, store.metric_series(conn, CID, None))
        return trends.metric_changes(CID, metric, store.metric_series(conn, CID, metric))


def test_a_run_added_twice_is_one_entry_with_its_figures(tmp_path: Path) -> None:
    db = tmp_path / "h.sqlite"
    run = nightly(tmp_path, 1, 12.0)
    k1, k2 = store.add_run(db, run), store.add_run(db, run)
    assert k1 == k2
    with store.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM runs").fetchone()[0] == 1
        assert conn.execute("SELECT count(*) FROM cells").fetchone()[0] == 2
        (p,) = store.metric_series(conn, CID, "accuracy.pdsweep_arith")
        assert p.value == pytest.approx(0.80) and p.lo == pytest.approx(0.80 - 1.96 * 0.0283, abs=1e-3)
        (g,) = store.metric_series(conn, CID, "gbps_wall")
        assert g.value == pytest.approx(12.0 * 0.6) and g.unit == "GB/s" and g.verdict == "PASS"
        assert g.build["vllm_version"] == "0.27.0"


def test_a_store_of_another_schema_or_no_store_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "old.sqlite"
    store.add_run(db, nightly(tmp_path, 1, 12.0))
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE meta SET value='0' WHERE key='schema_version'")
    with pytest.raises(UserError, match="schema version 0, this pdsweep reads version 1"):
        store.add_run(db, nightly(tmp_path, 2, 12.0))
    junk = tmp_path / "junk.sqlite"
    junk.write_text("not a database" * 100)
    with pytest.raises(UserError, match="not a pdsweep history store"):
        store.add_run(junk, nightly(tmp_path, 3, 12.0))
    with pytest.raises(UserError, match="no history store"):
        with store.connect(tmp_path / "none.sqlite", create=False):
            pass


def test_a_sustained_slowdown_is_flagged_at_its_first_run_with_the_build_difference(tmp_path: Path) -> None:
    db = history(tmp_path, [10.0, 10.3, 9.8, 10.1, 10.0, 5.0, 5.1, 4.9], vllm={6: "0.28.0", 7: "0.28.0", 8: "0.28.0"})
    (c,) = changes(db, "gbps_wall")
    assert (c.first.run_name, c.last_good.run_name, c.direction, c.status) == (
        "night-06",
        "night-05",
        "down",
        "lasting",
    )
    assert c.runs_since == 3 and c.ratio == pytest.approx(0.5, rel=0.03)
    assert c.build_diff == ("vllm version 0.27.0 -> 0.28.0",)
    assert "since night-06" in c.describe() and "lasting 3 runs" in c.describe()


def test_a_transient_and_noise_are_not_changes(tmp_path: Path) -> None:
    for seed in range(4):  # +-5 % noise, 12 nights: no change at the default 10 % / 3 robust sigma
        rng = random.Random(seed)
        noisy = [10.0 * (1 + rng.uniform(-0.05, 0.05)) for _ in range(12)]
        assert changes(history(tmp_path / f"n{seed}", noisy), "gbps_wall") == [], seed
    blip = [10.0, 10.2, 9.9, 10.1, 4.0, 10.0, 10.1]  # one slow night, then back
    assert changes(history(tmp_path / "b", blip), "gbps_wall") == []


def test_a_change_in_the_latest_run_is_new(tmp_path: Path) -> None:
    db = history(tmp_path, [10.0, 10.1, 9.9, 10.0, 20.0])
    (c,) = changes(db, "gbps_wall")
    assert (c.direction, c.status, c.build_diff) == ("up", "new", ())
    news = run_news(db, tmp_path / "runs" / "night-05")
    assert [x.metric for x in news.new] == ["gbps_wall", "gbps_xfer"] and news.lasting == ()
    assert run_news(db, tmp_path / "runs" / "night-04").new == ()


def test_a_cell_that_starts_failing_is_a_verdict_change(tmp_path: Path) -> None:
    db = history(tmp_path, [10.0] * 5, fail={4: True, 5: True}, vllm={4: "0.28.0", 5: "0.28.0"})
    (c,) = changes(db, "verdict")
    assert (c.first.run_name, c.direction, c.runs_since) == ("night-04", "fail", 2)
    assert "verdict PASS -> FAIL" in c.describe() and "vllm version 0.27.0 -> 0.28.0" in c.describe()
    assert changes(history(tmp_path / "flaky", [10.0] * 5, fail={3: True}), "verdict") == []


def test_history_commands_add_show_and_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "h.sqlite"
    runs = [nightly(tmp_path / "runs", i, g) for i, g in enumerate([10.0, 10.1, 9.9, 10.0, 5.0, 5.0], 1)]
    layout.write_text(runs[-1] / "summary.md", "# gate\nPASSED\n")
    assert main(["history", "add", *map(str, runs), "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "history: LASTING" in out and "gbps_wall" in out
    assert "## History" in (runs[-1] / "summary.md").read_text() and "# gate" in (runs[-1] / "summary.md").read_text()
    assert main(["history", "show", "--db", str(db), "--cell", "*p1d1*", "--metric", "gbps_wall"]) == 0
    out = capsys.readouterr().out
    assert f"{CID}\n  gbps_wall: " in out and "CHANGE" in out and "since night-05" in out
    assert main(["history", "add", str(tmp_path), "--db", str(db)]) == 2  # not a run directory


def dashboard(tmp_path: Path) -> tuple[Path, Path]:
    db = history(tmp_path, [10.0, 10.1, 9.9, 10.0, 5.0, 5.0])
    out = tmp_path / "dash.html"
    assert main(["dashboard", "--db", str(db), "--out", str(out)]) == 0
    return db, out


def test_dashboard_has_a_plot_per_cell_with_figures_and_marks_the_change(tmp_path: Path) -> None:
    _, out = dashboard(tmp_path)
    page = out.read_text()
    assert page.count("<img class='plot'") == 2  # the PD cell and its reference both have figures
    assert page.count("<section class='cell'") == 2
    assert "since night-05" in page and page.count("class='v'") == 12
    assert page.count("<tr><td><a href='") == 6 and "href='#'" not in page  # a run without report.html links too


def test_dashboard_renders_in_headless_chromium_without_console_errors(tmp_path: Path) -> None:
    need_chromium()
    _, out = dashboard(tmp_path)
    dom, logs = render(out, tmp_path)
    assert dom.count('class="plot"') == 2 and "pdsweep history" in dom
    assert console_errors(logs) == []
    broken = tmp_path / "broken.html"  # the check sees a script error
    broken.write_text(out.read_text().replace("getElementById('filter')", "getElementById('nope')"))
    _, logs = render(broken, tmp_path)
    assert any("Uncaught" in line for line in logs.splitlines())


def _zero_pages(db: Path) -> None:
    data = bytearray(db.read_bytes())
    data[4096:] = bytes(len(data) - 4096)  # every page after the first (the header and sqlite_master stay)
    db.write_bytes(bytes(data))


def _sql(statement: str):
    def damage(db: Path) -> None:
        with sqlite3.connect(db) as conn:
            conn.execute(statement)

    return damage


@pytest.mark.parametrize(
    "damage, why",
    [
        (_zero_pages, r"damaged history store \(SQLite: (database disk image is malformed|file is not a database)"),
        (_sql("DROP TABLE figures"), r"damaged history store \(SQLite: no such table: figures\)"),
        (_sql("DROP TABLE cells"), r"damaged history store \(SQLite: no such table: (main\.)?cells\)"),
        (
            _sql("UPDATE figures SET value = 'fast' WHERE metric = 'gbps_wall'"),
            r"damaged history store: figures row \(run .*, cell tiny-llama\.p1d1\.b16-16\.fixed, metric gbps_wall\) "
            r"holds value/lo/hi 'fast'/None/None, not numbers",
        ),
    ],
    ids=["zeroed-pages", "dropped-figures", "dropped-cells", "text-figure"],
)
@pytest.mark.parametrize("command", ["show", "dashboard"])
def test_a_damaged_store_is_an_error_naming_it_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage, why: str, command: str
) -> None:
    """Issue 59 case 6: `history show` and `dashboard` on a damaged store: exit 2, the store and the fault named."""
    import re

    db = history(tmp_path, [10.0, 10.1, 9.9])
    damage(db)
    argv = (
        ["history", "show", "--metric", "*"] if command == "show" else ["dashboard", "--out", str(tmp_path / "d.html")]
    )
    assert main([*argv, "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith(f"error: {db}: ") and re.search(why, err), err
