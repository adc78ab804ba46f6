"""The benchmark command's plumbing (issue 11): figures, goals, suite selection, the JSON it writes.

No timing is asserted here: numbers from a shared CI box say nothing; the suites only have to run.
"""

from __future__ import annotations

import json
import re

import pytest

from benchmarks.cli import main, resolve_suites
from benchmarks.core import Goal, SuiteResult, git_sha, print_report


def test_figure_summary_and_goals():
    res = SuiteResult("x", "title")
    res.add("speed", "tokens/s", [3.0, 1.0, 2.0])
    fig = res.ratio("a / b", [0.5, 0.7, 0.6], goal=Goal(">=", 0.9), limit="because")
    over = res.ratio("overhead", [0.01, 0.03, 0.02], goal=Goal("<=", 0.02), unit="fraction")
    d = res.to_dict()
    speed = d["figures"][0]
    assert (speed["min"], speed["median"], speed["max"], speed["n"]) == (1.0, 2.0, 3.0, 3)
    assert fig.met is False and d["figures"][1]["limit"] == "because"
    assert d["figures"][1]["gap"] == pytest.approx(0.6 / 0.9)
    assert over.met is True and d["figures"][2]["gap"] == pytest.approx(0.0)


def test_suite_selection_aliases_and_order():
    assert resolve_suites(None, "cpu")[0] == "orchestration" and len(resolve_suites(None, "cpu")) == 10
    assert resolve_suites(None, "cuda") == ["rollout", "train", "sync"]
    assert resolve_suites(["3,io"], "cpu") == ["rollout", "artifact_io"]
    assert resolve_suites(["replay", "1"], "cpu") == ["orchestration", "replay"]
    assert resolve_suites(["8"], "cpu") == resolve_suites(["watchdog_cost"], "cpu") == ["watchdog"]
    assert resolve_suites(["9"], "cpu") == ["cluster"]
    assert resolve_suites(["10"], "cpu") == resolve_suites(["end-to-end"], "cpu") == ["e2e"]
    with pytest.raises(SystemExit):
        resolve_suites(["nope"], "cpu")


def test_git_sha_is_a_commit_or_none():
    sha = git_sha()
    assert sha is None or re.fullmatch(r"[0-9a-f]{40,64}", sha)


def test_quick_run_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(
        [
            "--quick",
            "--repeats",
            "1",
            "--suite",
            "rollout",
            "--suite",
            "train",
            "--suite",
            "artifact_io",
            "--out",
            str(out),
            "--workdir",
            str(tmp_path / "work"),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["schema"] == "rollflow.bench/1"
    assert {"machine", "versions", "git_sha", "created_at"} <= set(report)
    assert list(report["suites"]) == ["rollout", "train", "artifact_io"]
    for suite in report["suites"].values():
        assert not suite.get("error"), suite.get("error")
        assert suite["figures"]
        for fig in suite["figures"]:
            assert fig["min"] <= fig["median"] <= fig["max"]
    names = [f["name"] for f in report["suites"]["artifact_io"]["figures"]]
    assert "file write: raw / store time" in names and "s3 write: raw / store time" in names
    ratio_names = [f["name"] for s in report["suites"].values() for f in s["figures"] if f["kind"] == "ratio"]
    printed = capsys.readouterr().out
    for name in ratio_names:  # every ratio is printed
        assert name in printed
    print_report(report)


def test_watchdog_cost_counts_what_the_deadline_does_and_prices_it(ray_local, tmp_path):
    """The direct-cost figure of benchmarks/watchdog_cost.py counts the real deadline's operations (a watched wait,
    its lookup of the awaited actor, one poll per slice; nothing without a watch) and prices each on a live actor."""
    from benchmarks.watchdog_cost import Counts, counting, direct_fraction, summarise, unit_costs
    from rollflow.infra import deadline
    from rollflow.infra.deadline import StallWatch, stacks_uri, watching
    from rollflow.infra.workers import start_actor, stop_actor
    from tests.test_watchdog import Plodder

    run = "wd-cost"
    actor = start_actor(run, "engine", Plodder)
    counts = Counts()
    watch = StallWatch(run, "generate", 1, 600.0, stacks_uri(str(tmp_path), run, 1, "generate"), poll_s=0.2)
    try:
        with counting(counts):
            # through the module attribute, as the typed clients call it (infra/clients.py)
            assert deadline.wait(actor.work.remote(1, 0.0)) == 1
            assert counts.take() == {}  # no watch: a plain ray.get
            with watching(watch):
                assert deadline.wait(actor.work.remote(10, 0.1)) == 10  # about 1 s: several 0.2 s slices
            seen = counts.take()
        assert seen["watched_waits"] == 1 and seen["lookups"] == 1 and 3 <= seen["polls"] <= 8, seen
        units = unit_costs(run, repeats=1)
    finally:
        stop_actor(run, "engine")
    assert set(units) == {"tick", "poll_driver", "poll_actor", "lookup", "watched_wait"}
    assert all(v >= 0 for v in units.values()) and units["poll_driver"] > units["tick"] > 0, units
    row = {"wall": 2.0, "ticks": 10, "polls": 3, "lookups": 1, "watched_waits": 4}
    expected = (10 * units["tick"] + 3 * (units["poll_driver"] + units["poll_actor"]) + units["lookup"]) / 2.0
    assert direct_fraction(row, units) == pytest.approx(expected + 4 * units["watched_wait"] / 2.0)

    def it(pair: int, on: bool, wall: float) -> dict:
        return {**(row if on else {}), "pair": pair, "watchdog": on, "wall": wall, "cpu": wall}

    raw = {
        "prompts": 8,
        "pairs": 2,
        "unit_cpu_s": units,
        "iterations": [it(0, True, 9.0), it(0, False, 1.0), it(1, False, 2.0), it(1, True, 2.2), it(2, True, 1.0)]
        + [it(2, False, 1.0)],
    }
    figures = {f.name: f for f in summarise(raw, SuiteResult("watchdog", "t")).figures}
    assert figures["paired iteration time, on / off"].values == pytest.approx([1.1, 1.0])  # warm-up pair left out
    assert figures["polls per watched iteration"].values == [3, 3]
