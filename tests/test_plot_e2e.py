"""benchmarks/plot_e2e.py: the e2e suite's JSON drawn as stacked bars (docs/performance.md section 7)."""

from __future__ import annotations

import json

import pytest

from benchmarks.plot_e2e import OTHER, bars_of, main


def _result(shape: str, iterations: list[dict]) -> dict:
    # the layout the e2e suite writes (suites.e2e.params / data.iterations), built by hand
    return {"suites": {"e2e": {"params": {"shape": shape}, "data": {"startup_s": 1.0, "iterations": iterations}}}}


def _iteration(generate: float, train: float, sync: float, release: float, offload: float, total: float) -> dict:
    seconds = {
        "generate": generate,
        "reward": 0.01,
        "persist": 0.02,
        "engine_release": release,
        "train": train,
        "engine_resume_weights": 0.1,
        "sync": sync,
        "parity": 0.05,
        "trainer_offload": offload,
    }
    return {"seconds": seconds, "iteration_s": total}


def test_first_and_median_steady_bars_sum_to_their_iterations():
    runs = [
        _iteration(40.0, 20.0, 2.0, 1.0, 10.0, 74.0),
        _iteration(10.0, 8.0, 1.0, 0.5, 0.4, 20.5),
        _iteration(12.0, 9.0, 3.0, 0.7, 0.6, 26.0),
        _iteration(11.0, 7.0, 2.0, 0.6, 0.5, 21.9),
    ]
    first, steady = bars_of(_result("1.5b", runs))
    assert first.label == "1.5b first" and steady.label == "1.5b steady"
    assert first.seconds["generate"] == 40.0 and first.seconds["train"] == 20.0
    assert first.seconds["engine release / resume"] == pytest.approx(1.1)
    assert first.seconds["trainer onload / offload"] == 10.0
    assert first.total == pytest.approx(74.0)  # the bar is the iteration; the rest is "other"
    assert first.seconds[OTHER] == pytest.approx(74.0 - (40 + 20 + 2 + 0.05 + 1.1 + 10))
    # the steady iteration of median length (21.9 s of 20.5, 21.9, 26.0), stage by stage
    assert steady.seconds["generate"] == 11.0 and steady.seconds["train"] == 7.0 and steady.seconds["sync"] == 2.0
    assert steady.total == pytest.approx(21.9)
    two = bars_of(_result("0.5b", runs[:3]))[1]  # two steady iterations: the shorter of the middle two
    assert two.total == pytest.approx(20.5) and two.seconds["generate"] == 10.0


def test_a_json_without_a_finished_iteration_is_named():
    with pytest.raises(ValueError, match="3b: no finished iteration"):
        bars_of(_result("3b", []))


def test_main_writes_a_png(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from matplotlib import image

    paths = []
    for shape in ("0.5b", "1.5b"):
        path = tmp_path / f"{shape}.json"
        path.write_text(json.dumps(_result(shape, [_iteration(30, 15, 1, 1, 5, 53), _iteration(9, 8, 1, 1, 0.3, 20)])))
        paths.append(str(path))
    out = tmp_path / "img" / "stages.png"
    assert main([*paths, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = image.imread(out).shape[:2]
    assert width > 600 and height > 200
