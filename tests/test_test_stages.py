"""scripts/test_stages.sh (`make test`): both stages run, either failing fails the whole, and where a CPU cgroup can
be made the cluster stage runs in one of its own, weighted above the default, beside the suite."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "test_stages.sh"

# Stands in for the venv's python: records which stage it is, its cpu cgroup and when it ran, then exits with the
# status the test asks of that stage.
STUB = """#!/bin/bash
case "$*" in *"-m cluster"*) stage=cluster ;; *) stage=suite ;; esac
group=$(sed -n 's/^[0-9]*:cpu:\\(.*\\)$/\\1/p' /proc/self/cgroup)
[ -z "$group" ] && group=$(sed -n 's/^0::\\(.*\\)$/\\1/p' /proc/self/cgroup)
weight=-
for f in /sys/fs/cgroup/cpu$group/cpu.shares /sys/fs/cgroup$group/cpu.weight; do [ -f "$f" ] && weight=$(cat "$f"); done
echo "$stage start $(date +%s.%N) $group $weight $*" >> "$RECORD"
sleep 1
echo "$stage end $(date +%s.%N)" >> "$RECORD"
eval exit \\${EXIT_$stage:-0}
"""


def _cgroup_possible() -> bool:
    if os.geteuid() != 0:
        return False
    v1 = Path("/sys/fs/cgroup/cpu/cgroup.procs")
    if v1.exists():
        return os.access(v1, os.W_OK)
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    return v2.exists() and "cpu" in v2.read_text().split()


def _run(tmp_path, **env) -> tuple[int, dict[str, dict], str]:
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    record = tmp_path / "record.txt"
    record.unlink(missing_ok=True)
    proc = subprocess.run(
        ["bash", str(SCRIPT)],
        env={**os.environ, "PY": str(stub), "RECORD": str(record), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    stages: dict[str, dict] = {}
    for line in record.read_text().splitlines():
        # "<stage> start <time> <cgroup> <weight> <args...>" or "<stage> end <time>"
        stage, what, when, *rest = line.split(" ", 5)
        stages.setdefault(stage, {})[what] = float(when)
        if what == "start":
            stages[stage].update(zip(("group", "weight", "args"), rest))
    return proc.returncode, stages, proc.stdout + proc.stderr


def test_serial_runs_the_suite_then_the_cluster_tests_and_fails_if_either_fails(tmp_path):
    rc, stages, out = _run(tmp_path, TEST_STAGES="serial")
    assert rc == 0, out
    assert stages["suite"]["end"] <= stages["cluster"]["start"]
    assert "-m not cluster" in stages["suite"]["args"] and "-n 4" in stages["suite"]["args"]
    assert stages["cluster"]["args"].endswith("-m cluster")
    assert stages["suite"]["group"] == stages["cluster"]["group"]
    for failing in ("suite", "cluster"):
        rc, stages, out = _run(tmp_path, TEST_STAGES="serial", **{f"EXIT_{failing}": "3"})
        assert rc == 1 and set(stages) == {"suite", "cluster"}, out


@pytest.mark.skipif(not _cgroup_possible(), reason="needs root and a writable CPU cgroup (v1 cpu or v2 +cpu)")
def test_with_a_cgroup_the_cluster_stage_runs_beside_the_suite_weighted_4x_and_the_group_is_removed(tmp_path):
    rc, stages, out = _run(tmp_path, TEST_WORKERS="2")
    assert rc == 0, out
    suite, cluster = stages["suite"], stages["cluster"]
    assert cluster["start"] < suite["end"] and suite["start"] < cluster["end"], stages  # the two overlap
    assert "-n 2" in suite["args"]
    assert cluster["group"] != suite["group"] and "rollflow-test-cluster-" in cluster["group"], stages
    assert cluster["weight"] in ("4096", "400"), stages  # v1 shares (default 1024) / v2 weight (default 100)
    # the cluster stage's output comes after the suite's, and its group is gone once the script ends
    assert out.index("cluster tests (pytest -m cluster, beside the suite)") > out.index("running beside the suite")
    assert not any(Path(base + cluster["group"]).exists() for base in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup"))
    rc, stages, out = _run(tmp_path, EXIT_cluster="5")
    assert rc == 1 and set(stages) == {"suite", "cluster"}, out
