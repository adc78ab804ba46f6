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
    assert resolve_suites(None, "cpu")[0] == "orchestration" and len(resolve_suites(None, "cpu")) == 7
    assert resolve_suites(None, "cuda") == ["rollout", "train", "sync"]
    assert resolve_suites(["3,io"], "cpu") == ["rollout", "artifact_io"]
    assert resolve_suites(["replay", "1"], "cpu") == ["orchestration", "replay"]
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
