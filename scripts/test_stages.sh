#!/usr/bin/env bash
# `make test`'s two stages: the suite without the cluster tests on pytest-xdist workers, and the cluster tests
# (tests/test_cluster.py: PostgreSQL, S3, a Prefect server, a work pool and three Ray nodes in network namespaces).
# Both always run; the exit status is a failure if either failed.
#
# The cluster stage mostly waits on its drills' clocks (~30% of 2 cores over its 8 min), so where this process may
# create a CPU cgroup (root, cgroup v1 `cpu` or v2 with the `cpu` controller) it runs beside the suite in its own
# group weighted 4x the default: whenever the drills want CPU they get it first, whatever the suite does, and every
# process a drill starts (`setsid` or not: PostgreSQL, `ray start`, flow runs) stays in that group. Nice values
# cannot do this: with the kernel's session autogroups a niced suite also falls below every process it starts in a
# session of its own. Without a cgroup (not root, read-only cgroup fs) or with TEST_STAGES=serial the cluster
# stage runs after the suite, alone. Its output is printed after the suite's either way.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORKERS=${TEST_WORKERS:-4}
SUITE=("$PY" -m pytest -q -rs -n "$WORKERS" --dist loadfile --no-loadscope-reorder --durations=25 -m "not cluster")
CLUSTER=("$PY" -m pytest -q -rs --durations=12 -m cluster)

# A fresh CPU cgroup for the cluster stage, weighted 4x; prints its folder, or nothing when none can be made.
make_group() {
  local name="rollflow-test-cluster-$$" dir
  if [ -w /sys/fs/cgroup/cpu/cgroup.procs ] && [ -f /sys/fs/cgroup/cpu/cpu.shares ]; then
    dir=/sys/fs/cgroup/cpu/$name  # v1: shares, default 1024
    mkdir "$dir" 2>/dev/null && echo 4096 > "$dir/cpu.shares" 2>/dev/null && echo "$dir" && return
  elif [ -f /sys/fs/cgroup/cgroup.subtree_control ] && grep -qw cpu /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
    dir=/sys/fs/cgroup/$name  # v2: weight, default 100
    grep -qw cpu /sys/fs/cgroup/cgroup.subtree_control || echo +cpu > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null
    mkdir "$dir" 2>/dev/null && echo 400 > "$dir/cpu.weight" 2>/dev/null && echo "$dir" && return
  fi
  [ -n "${dir:-}" ] && rmdir "$dir" 2>/dev/null
  return 0
}

rc=0
group=""
[ "${TEST_STAGES:-}" = serial ] || group=$(make_group)
if [ -z "$group" ]; then
  "${SUITE[@]}" || rc=1
  "${CLUSTER[@]}" || rc=1
  exit $rc
fi

log=$(mktemp /tmp/rollflow-cluster-stage.XXXXXX)
(echo "$BASHPID" > "$group/cgroup.procs" && exec "${CLUSTER[@]}") > "$log" 2>&1 &
cluster_pid=$!
# Ctrl-C or a CI timeout: the cluster stage stops its own services (by pid) on SIGINT, as at a terminal.
trap 'kill -INT $cluster_pid 2>/dev/null' INT TERM
echo "cluster tests: running beside the suite in CPU cgroup $group (output below, after the suite's)"
"${SUITE[@]}" || rc=1
wait $cluster_pid || rc=1
trap - INT TERM
echo "================ cluster tests (pytest -m cluster, beside the suite) ================"
cat "$log"
rm -f "$log"
rmdir "$group" 2>/dev/null || echo "note: $group still holds processes the cluster stage left: $(cat "$group/cgroup.procs" | tr '\n' ' ')"
exit $rc
