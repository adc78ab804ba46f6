"""IMA triage (issue 8): verdict logic, toggle maps, environment, log scan, the cell runner, the flow."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from rollflow.tasks.debug.ima import (
    COREDUMP,
    CRASH,
    ERROR,
    LAUNCH_BLOCKING,
    MATRIX,
    NA,
    PASS,
    TIMEOUT,
    Cell,
    backend_toggles,
    cell_env,
    classify,
    faulting_kernel,
    first_error_line,
    innermost_frame,
    parse_toggles,
    run_cell,
    toggle_matrix,
    trainer_flags,
    verdict,
)


def t(cg: str, sp: str, ep: str = "off") -> dict[str, str]:
    return {"cuda_graph": cg, "speculative": sp, "deepep": ep}


def hf_cells(crashing: set[tuple[str, str]], outcome: str = CRASH) -> list[tuple[dict, str]]:
    """The hf engine's matrix: 4 cells run (deepep off), 4 are n/a (deepep on)."""
    cells = []
    for ep in ("off", "on"):
        for cg in ("off", "on"):
            for sp in ("off", "on"):
                if ep == "on":
                    cells.append((t(cg, sp, ep), NA))
                else:
                    cells.append((t(cg, sp), outcome if (cg, sp) in crashing else PASS))
    return cells


# ----------------------------------------------------------------------------------------------- verdict


def test_verdict_crashes_only_with_cuda_graph_on():
    v = verdict(hf_cells({("on", "off"), ("on", "on")}))
    assert v.kind == "isolated"
    assert v.text == "crashes only with cuda_graph on"
    assert v.condition == {"cuda_graph": "on"}
    assert len(v.failing) == 2 and len(v.passing) == 2 and len(v.not_applicable) == 4


def test_verdict_needs_both_toggles_and_drops_the_constant_deepep():
    v = verdict(hf_cells({("on", "on")}))
    assert v.text == "crashes only with cuda_graph on and speculative on"
    assert v.condition == {"cuda_graph": "on", "speculative": "on"}  # deepep=off holds everywhere: not named


def test_verdict_crashes_only_with_speculative_off():
    v = verdict(hf_cells({("off", "off"), ("on", "off")}))
    assert v.text == "crashes only with speculative off"


def test_verdict_every_cell_crashes():
    v = verdict(hf_cells({("off", "off"), ("off", "on"), ("on", "off"), ("on", "on")}))
    assert v.kind == "all_crash"
    assert v.text == "crashes in every cell: not toggle-related"


def test_verdict_no_crash():
    v = verdict(hf_cells(set()))
    assert v.kind == "no_crash"
    assert v.text == "no crash reproduced (4 cells passed)"


def test_verdict_any_toggle_on_crashes():
    v = verdict(hf_cells({("off", "on"), ("on", "off"), ("on", "on")}))
    assert v.kind == "isolated_pass"
    assert v.condition == {"cuda_graph": "off", "speculative": "off"}
    assert v.text == (
        "crashes unless cuda_graph off and speculative off (passes only with cuda_graph off and "
        "speculative off; switching any of them crashes)"
    )


def test_verdict_xor_pattern_is_mixed():
    v = verdict(hf_cells({("off", "off"), ("on", "on")}))
    assert v.kind == "mixed"
    assert v.text == (
        "crashes in 2 of 4 cells with no single toggle pattern (cuda_graph=off,speculative=off,"
        "deepep=off; cuda_graph=on,speculative=on,deepep=off): rerun to check for flakiness"
    )


def test_verdict_full_matrix_deepep_only():
    cells = [(c.toggles(), CRASH if c.deepep else PASS) for c in toggle_matrix()]
    v = verdict(cells)
    assert v.text == "crashes only with deepep on"
    cells = [(c.toggles(), CRASH if (c.deepep and c.cuda_graph) else PASS) for c in toggle_matrix()]
    assert verdict(cells).text == "crashes only with cuda_graph on and deepep on"


def test_verdict_hangs_count_as_failures():
    cells = hf_cells({("on", "off")}) + []
    cells = [(tg, TIMEOUT if o == CRASH else o) for tg, o in cells]
    cells[3] = (cells[3][0], CRASH)  # cg on, sp on
    v = verdict(cells)
    assert v.text == "fails (crash or hang) only with cuda_graph on"


def test_verdict_errors_are_inconclusive_and_reported():
    cells = hf_cells({("on", "on")})
    cells[0] = (cells[0][0], ERROR)
    v = verdict(cells)
    assert v.text == (
        "crashes only with cuda_graph on and speculative on (1 cell(s) errored without a CUDA error "
        "or signal: see the table)"
    )
    assert v.inconclusive == [t("off", "off")]


def test_verdict_nothing_ran():
    v = verdict([(c.toggles(), NA) for c in toggle_matrix()])
    assert v.kind == "nothing_ran"
    assert v.text == "nothing ran: every cell was n/a or errored"


# ----------------------------------------------------------------------------------- toggles and flags


def test_parse_toggles():
    assert parse_toggles("cuda_graph=on, speculative=off") == {"cuda_graph": "on", "speculative": "off"}
    assert parse_toggles('{"deepep": true}') == {"deepep": "on"}
    assert parse_toggles("always") == {} and parse_toggles(None) == {}
    with pytest.raises(ValueError, match="unknown toggle 'cuda_graphs'; known: cuda_graph, speculative, deepep"):
        parse_toggles("cuda_graphs=on")
    with pytest.raises(ValueError, match="expected on or off"):
        parse_toggles("cuda_graph=maybe")
    with pytest.raises(ValueError, match="is not toggle=on"):
        parse_toggles("cuda_graph")


def test_matrix_has_eight_cells_deepep_last():
    cells = toggle_matrix()
    assert len(cells) == 8 and len(set(cells)) == 8
    assert [c.deepep for c in cells] == [False] * 4 + [True] * 4
    assert cells[3].key == "cg1-sp1-ep0" and cells[3].label == "cuda_graph=on speculative=on deepep=off"


def test_sglang_flags():
    sg = backend_toggles("sglang")
    off = sg.plan(Cell())
    assert off.engine_flags == ("--disable-cuda-graph", "--moe-a2a-backend", "none")
    on = sg.plan(Cell(cuda_graph=True, speculative=True, deepep=True))
    assert on.engine_flags == (
        "--speculative-algorithm",
        "EAGLE",
        "--moe-a2a-backend",
        "deepep",
        "--deepep-mode",
        "auto",
    )
    assert on.trainer_flags == ("--moe-enable-deepep",)
    assert all(sg.plan(c).applicable for c in toggle_matrix())
    assert trainer_flags(Cell()) == ()


def test_hf_mapping_and_na_cells():
    hf = backend_toggles("hf")
    plans = [hf.plan(c) for c in toggle_matrix()]
    assert [p.applicable for p in plans] == [True] * 4 + [False] * 4
    assert all("DeepEP" in p.reason for p in plans[4:])
    graph = hf.plan(Cell(cuda_graph=True))
    assert graph.generate_kwargs == {"cache_implementation": "static"}
    eager = hf.plan(Cell())
    assert eager.generate_kwargs == {"cache_implementation": "dynamic", "disable_compile": True}
    spec = hf.plan(Cell(cuda_graph=True, speculative=True))
    assert spec.generate_kwargs["prompt_lookup_num_tokens"] == 3 and spec.rollout_overrides == {"max_batch_size": 1}
    assert spec.generate_kwargs["max_cache_len"] == "auto"


def test_cell_env(tmp_path):
    assert cell_env(MATRIX) == {}
    assert cell_env(LAUNCH_BLOCKING) == {"CUDA_LAUNCH_BLOCKING": "1"}
    env = cell_env(COREDUMP, coredump_dir=tmp_path / "coredumps", cell_key="cg1-sp0-ep0")
    assert env["CUDA_ENABLE_COREDUMP_ON_EXCEPTION"] == "1"
    assert env["CUDA_ENABLE_CPU_COREDUMP_ON_EXCEPTION"] == "0"
    assert env["CUDA_COREDUMP_FILE"] == str(tmp_path / "coredumps" / "core_cg1-sp0-ep0_%h_%p.nvcudmp")
    assert env["CUDA_COREDUMP_GENERATION_FLAGS"] == (
        "skip_nonrelocated_elf_images,skip_global_memory,skip_shared_memory,skip_local_memory"
    )
    assert "CUDA_LAUNCH_BLOCKING" not in env


# ------------------------------------------------------------------------------------------- log scan

TORCH_ASYNC = """\
Traceback (most recent call last):
  File "/x/tasks/rollout/hf_engine.py", line 140, in _generate_batch
    new_tokens = out.sequences[:, width:].cpu()
RuntimeError: CUDA error: an illegal memory access was encountered
CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.
For debugging consider passing CUDA_LAUNCH_BLOCKING=1
""".splitlines()

GDB = """\
Opening GPU coredump: /r/coredumps/core_cg1-sp0-ep0_h_42.nvcudmp
[Current focus set to CUDA kernel 0, grid 7, block (0,0,0), thread (0,0,0), device 0, sm 0, warp 0, lane 0]
CUDA Exception: Warp Illegal Address
The exception was triggered at PC 0x7f3a4c0b1d70  rollflow_ima_oob_store
#0  0x00007f3a4c0b1d80 in rollflow_ima_oob_store<<<(1,1,1),(128,1,1)>>> ()
""".splitlines()


def test_first_error_line_and_frame():
    line, kind = first_error_line(TORCH_ASYNC)
    assert line == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert kind == "illegal memory access"
    assert innermost_frame(TORCH_ASYNC) == "/x/tasks/rollout/hf_engine.py:140 in _generate_batch"
    assert first_error_line(["all good"]) == (None, None)
    assert first_error_line(["RuntimeError: CUDA error: device-side assert triggered"])[1] == "device-side assert"


def test_faulting_kernel_names():
    assert faulting_kernel(GDB) == "rollflow_ima_oob_store"
    trace = TORCH_ASYNC + ["rollflow-ima: last Triton kernel launched before the error: rollflow_ima_oob_store"]
    assert faulting_kernel(trace) == "rollflow_ima_oob_store"
    assert faulting_kernel(TORCH_ASYNC) is None


# Lines of the launch-blocking rerun on the H200 (benchmarks/results/h200-ima-bisect-2026-12-02.md).
H200_LAUNCH_BLOCKING = """\
rollflow-ima: injected fault triton_oob in decode step 1
Traceback (most recent call last):
  File "/work/main/tasks/rollout/ima_repro.py", line 136, in __call__
    fire(kind, scores, current)
  File "/work/main/tasks/rollout/ima_kernels.py", line 27, in oob_store
    rollflow_ima_oob_store[(triton.cdiv(n, block),)](t, t, n, far, BLOCK=block)
  File "/opt/torch/.venv/lib/python3.12/site-packages/triton/runtime/jit.py", line 744, in run
    kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata,
  File "/opt/torch/.venv/lib/python3.12/site-packages/triton/backends/nvidia/driver.py", line 713, in __call__
    self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered
rollflow-ima: last Triton kernel launched before the error: rollflow_ima_oob_store
""".splitlines()


def test_launch_blocking_log_names_kernel_and_call_site(tmp_path):
    fake = _fake_python(
        tmp_path,
        f"""
        import sys
        sys.stderr.write({chr(10).join(H200_LAUNCH_BLOCKING)!r} + "\\n")
        sys.exit(1)
    """,
    )
    r = run_cell("{{}}", Cell(cuda_graph=True), pass_name=LAUNCH_BLOCKING, run_dir=tmp_path / "run", python=fake)
    assert r.outcome == CRASH and r.kernel == "rollflow_ima_oob_store"
    assert r.first_error == "RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered"
    assert r.frame.endswith("triton/backends/nvidia/driver.py:713 in __call__")
    assert r.user_frame == "/work/main/tasks/rollout/ima_kernels.py:27 in oob_store"


def test_transformers_refusal_is_not_applicable():
    from rollflow.tasks.debug.ima_repro import unsupported_combination

    def refused(message: str, filename: str):
        code = compile(f"raise ValueError({message!r})", filename, "exec")
        try:
            exec(code, {})
        except ValueError as exc:
            return exc

    exc = refused(
        "assisted generate is not supported with Static cache classes",
        "/x/site-packages/transformers/generation/utils.py",
    )
    assert unsupported_combination(exc, fault_fired=False).endswith(
        "cannot run this combination: assisted generate is not supported with Static cache classes"
    )
    assert unsupported_combination(exc, fault_fired=True) is None  # after the fault: a failure, never n/a
    assert unsupported_combination(refused("not supported", "/x/my_code.py"), fault_fired=False) is None
    assert (
        unsupported_combination(refused("bad value", "/x/transformers/generation/utils.py"), fault_fired=False) is None
    )


def test_classify():
    assert classify(0, False, ["ok"]) == (PASS, None, None)
    assert classify(1, False, TORCH_ASYNC)[0] == CRASH
    assert classify(
        -6, False, ["rollflow-ima: injected fault abort in decode step 1", "Fatal Python error: Aborted"]
    ) == (CRASH, "rollflow-ima: injected fault abort in decode step 1", None)
    assert classify(-11, False, [])[1] == "killed by SIGSEGV"
    assert classify(1, False, ["ValueError: bad config"]) == (ERROR, "ValueError: bad config", None)
    assert classify(78, False, ["rollflow-ima: unsupported: no engine"]) == (NA, "no engine", None)
    assert classify(-9, True, [])[0] == TIMEOUT


def _fake_python(tmp_path: Path, body: str) -> str:
    """An executable standing in for `python -m rollflow.tasks.debug.ima_repro ...` (no torch import: fast)."""
    script = tmp_path / "fake-python"
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_run_cell_kills_a_hang_and_keeps_going(tmp_path):
    fake = _fake_python(
        tmp_path,
        """
        import time
        print("generating", flush=True)
        time.sleep(300)
    """,
    )
    # 8 s, not 1: on a loaded 2-core CI box the fake's interpreter alone took over a second to print its line
    r = run_cell("{}", Cell(cuda_graph=True), run_dir=tmp_path / "run", timeout_s=8.0, python=fake)
    assert r.outcome == TIMEOUT and r.seconds < 60
    assert "killed" in r.note and r.log_tail[-1] == "generating"


def test_run_cell_captures_cuda_error_env_and_coredumps(tmp_path):
    fake = _fake_python(
        tmp_path,
        """
        import os, sys
        pattern = os.environ.get("CUDA_COREDUMP_FILE")
        if pattern:
            open(pattern.replace("%h", "host").replace("%p", str(os.getpid())), "w").write("dump")
        print("launch blocking:", os.environ.get("CUDA_LAUNCH_BLOCKING"), flush=True)
        print("RuntimeError: CUDA error: an illegal memory access was encountered", file=sys.stderr, flush=True)
        sys.exit(1)
    """,
    )
    os.environ["CUDA_LAUNCH_BLOCKING"] = "1"  # an inherited debug variable must not leak into the matrix pass
    try:
        r = run_cell("{}", Cell(), run_dir=tmp_path / "run", timeout_s=30, python=fake)
    finally:
        del os.environ["CUDA_LAUNCH_BLOCKING"]
    assert r.outcome == CRASH and r.error_kind == "illegal memory access"
    assert r.first_error == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert "launch blocking: None" in r.log_tail and r.coredumps == []
    cd = run_cell("{}", Cell(), pass_name=COREDUMP, run_dir=tmp_path / "run", timeout_s=30, python=fake)
    assert [Path(p).name for p in cd.coredumps] == [
        f"core_cg0-sp0-ep0_host_{Path(p).name.split('_')[-1]}" for p in cd.coredumps
    ]
    assert len(cd.coredumps) == 1 and Path(cd.coredumps[0]).parent == tmp_path / "run" / "coredumps"
    lb = run_cell("{}", Cell(), pass_name=LAUNCH_BLOCKING, run_dir=tmp_path / "run", timeout_s=30, python=fake)
    assert "launch blocking: 1" in lb.log_tail
    na = run_cell("{}", Cell(deepep=True), run_dir=tmp_path / "run", python=fake)
    assert na.outcome == NA and "DeepEP" in na.note


def test_cli_registers_bisect_and_rejects_a_bad_toggle(tmp_path):
    import typer
    from typer.testing import CliRunner

    from rollflow.flows.cli.bisect import register

    app = typer.Typer()
    register(app)

    @app.command("noop")
    def noop() -> None:  # a second command keeps typer from collapsing the app into one command
        pass

    runner = CliRunner()
    help_text = runner.invoke(app, ["bisect", "--help"]).output
    for option in ("--crash-when", "--timeout-s", "--config", "--set", "--local"):
        assert option in help_text
    bad = runner.invoke(app, ["bisect", "--set", f"store.root={tmp_path}", "--crash-when", "cuda_graphs=on", "--local"])
    assert bad.exit_code == 2 and "unknown toggle" in bad.output


# ---------------------------------------------------------------------------------------------- the flow


@pytest.mark.slow
def test_flow_isolates_the_crashing_combination(tmp_path, prefect_api, monkeypatch):
    """The bisect flow on CPU with an injected crash; it tracks to MLflow and TensorBoard, and its verdict table
    reaches both (checked on this same bisect: each one runs 10 cells)."""
    from mlflow.tracking import MlflowClient
    from prefect.artifacts import Artifact
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rollflow.flows import tracking
    from rollflow.flows.bisect import ima_bisect
    from tests.test_tracking import mlflow_run, tracked_config

    problems: list[str] = []  # tracking warnings
    monkeypatch.setattr(tracking, "report_problem", problems.append)
    cfg = tracked_config(
        tmp_path,
        "ima-t",
        backends=["mlflow", "tensorboard"],
        data={"prompts_per_rollout": 4},
        rollout={"n_samples_per_prompt": 2},
    )
    out = ima_bisect(cfg, crash_when="cuda_graph=on,speculative=on", timeout_s=120, parallel=2)

    assert out["verdict"]["text"] == "crashes only with cuda_graph on and speculative on"
    assert out["verdict"]["condition"] == {"cuda_graph": "on", "speculative": "on"}
    outcomes = {
        (c["toggles"]["cuda_graph"], c["toggles"]["speculative"], c["toggles"]["deepep"]): c["outcome"]
        for c in out["cells"]
    }
    assert outcomes == {
        ("off", "off", "off"): PASS,
        ("off", "on", "off"): PASS,
        ("on", "off", "off"): PASS,
        ("on", "on", "off"): CRASH,
        ("off", "off", "on"): NA,
        ("off", "on", "on"): NA,
        ("on", "off", "on"): NA,
        ("on", "on", "on"): NA,
    }
    crash = next(c for c in out["cells"] if c["outcome"] == CRASH)
    assert crash["signal"] == "SIGABRT" and "injected fault abort" in crash["first_error"]
    assert "tasks/debug/ima_repro.py:" in crash["user_frame"] and crash["user_frame"].endswith(" in fire")
    # Reruns of the crashing cell: launch blocking, then the core-dump environment.
    assert [(r["pass_name"], r["outcome"], r["env"].get("CUDA_LAUNCH_BLOCKING")) for r in out["reruns"]] == [
        (LAUNCH_BLOCKING, CRASH, "1"),
        (COREDUMP, CRASH, None),
    ]
    assert out["reruns"][1]["env"]["CUDA_ENABLE_COREDUMP_ON_EXCEPTION"] == "1"
    assert out["reruns"][1]["env"]["CUDA_COREDUMP_FILE"].startswith(str(tmp_path / "ima-t" / "coredumps"))
    assert out["coredumps"] == []  # CPU: nothing to dump

    report = Path(out["json_path"])
    assert report == tmp_path / "ima-t" / "coredumps" / "ima_report.json"
    assert json.loads(report.read_text())["verdict"]["kind"] == "isolated"
    assert (tmp_path / "ima-t" / "ima_logs" / "matrix-cg1-sp1-ep0.log").exists()

    table = Artifact.get("ima-t-ima-matrix")
    assert table is not None and table.type == "table"
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert len(rows) == 10  # every cell of the matrix, n/a included, plus the two reruns
    assert [r["pass"] for r in rows] == [MATRIX] * 8 + [LAUNCH_BLOCKING, COREDUMP]
    na_rows = [r for r in rows if r["outcome"] == NA]
    assert len(na_rows) == 4 and all(r["deepep"] == "on" and "DeepEP" in r["first_error"] for r in na_rows)
    markdown = Artifact.get("ima-t-ima-verdict")
    assert "**Verdict: crashes only with cuda_graph on and speculative on**" in markdown.data
    assert 'cuda-gdb -ex "target cudacore <file>"' in markdown.data
    link = Artifact.get("ima-t-ima-report")  # Prefect stores a link artifact as markdown
    assert link is not None and report.as_uri() in link.data

    verdict = out["verdict"]["text"]
    uri = tracking.mlflow_uri(cfg)
    [run] = mlflow_run(uri, "rollflow-test", "ima-t-ima-bisect")
    assert run.data.tags["summary.ima.verdict"] == verdict and run.data.tags["rollflow.flow"] == "ima_bisect"
    assert run.data.tags["rollflow.ima_report"] == out["report_uri"]
    client = MlflowClient(tracking_uri=uri)
    table = Path(client.download_artifacts(run.info.run_id, "ima_verdict.md", str(tmp_path / "dl"))).read_text()
    assert f"**Verdict: {verdict}**" in table and "cuda_graph" in table  # the matrix, one row per cell
    [tb] = list((tmp_path / "ima-t" / "tensorboard" / "ima_bisect").iterdir())
    acc = EventAccumulator(str(tb), size_guidance={"tensors": 0})
    acc.Reload()
    [event] = acc.Tensors("ima_verdict")
    assert f"**Verdict: {verdict}**" in event.tensor_proto.string_val[0].decode()
    assert problems == []
