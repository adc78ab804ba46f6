"""flows/ reaches its actors only through the typed clients (rollflow.infra.clients), built by the
run's WorkerGroup (issue 15, part 2): no method names in strings, every client method calls an
operation the worker really has, data-parallel fan-out and the control group live in the clients,
and the placement plan is computed once per group. No Ray cluster needed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import small_config

REPO = Path(__file__).resolve().parents[1]
# `.call("rollout", ...)`, `.submit('named_weights')`, `.control("abort")`, `getattr(actor, "ping")`
STRING_DISPATCH = re.compile(r"""\.(?:call|submit|control)\(\s*f?["']|getattr\([^,()]*actor[^,()]*,\s*f?["']""")


def string_dispatches(root: Path, base: Path = REPO) -> list[str]:
    """`file:line: code` of every string-dispatched actor call in the .py files under `root`."""
    hits = []
    for path in sorted(root.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            if STRING_DISPATCH.search(line):
                hits.append(f"{path.relative_to(base)}:{n}: {line.strip()}")
    return hits


def test_flows_call_no_actor_method_by_name():
    hits = string_dispatches(REPO / "flows")
    assert not hits, ("flows/ calls actor methods by name in a string; use the typed clients "
                      "(rollflow.infra.clients, through flows/group.py:WorkerGroup):\n" + "\n".join(hits))


def test_the_scan_catches_string_dispatch(tmp_path):
    (tmp_path / "bad.py").write_text('x = 1\nengine.call("rollout", 0)\ntrainer.submit(\'named_weights\')\n'
                                     'h.control("abort")\ngetattr(self.actor, "ping")\nengine.rollout(0)\n')
    hits = string_dispatches(tmp_path, base=tmp_path)
    assert [h.split(": ", 1)[0] for h in hits] == ["bad.py:2", "bad.py:3", "bad.py:4", "bad.py:5"]


def _remote_calls_by_class(source: str) -> dict[str, set[str]]:
    """Per class of infra/clients.py, the actor methods it calls (`<x>.NAME.remote(` / `.NAME.options(`)."""
    out: dict[str, set[str]] = {}
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        names = out.setdefault(cls.name, set())
        for node in ast.walk(cls):
            if (isinstance(node, ast.Attribute) and node.attr in ("remote", "options")
                    and isinstance(node.value, ast.Attribute)):
                names.add(node.value.attr)
    return out


def test_every_client_method_calls_an_operation_the_worker_has():
    from rollflow.tasks.rollout.server_worker import SGLangServerWorker
    from rollflow.tasks.rollout.worker import RolloutWorker
    from rollflow.tasks.train.critic_worker import CriticWorker
    from rollflow.tasks.train.worker import TrainWorker

    workers = {"TrainerClient": TrainWorker, "EngineClient": RolloutWorker, "ServerClient": SGLangServerWorker,
               "CriticClient": CriticWorker}
    called = _remote_calls_by_class((REPO / "infra" / "clients.py").read_text())
    for client, worker in workers.items():
        assert called.get(client), f"{client} calls no actor method"
        missing = sorted(name for name in called[client] if not callable(getattr(worker, name, None)))
        assert not missing, f"{client} calls {missing}, which {worker.__name__} does not have"


# -- fan-out and control group, with stand-in actors (no Ray) ---------------------------------------------
class _Method:
    def __init__(self, actor, name, group=None):
        self.actor, self.name, self.group = actor, name, group

    def options(self, concurrency_group=None):
        return _Method(self.actor, self.name, concurrency_group)

    def remote(self, *args, **kwargs):
        self.actor.log.append((self.actor.rank, self.name, self.group, args, kwargs))
        return self.actor.answers.get(self.name, (self.name, self.actor.rank))


class _Actor:
    def __init__(self, rank, log, **answers):
        self.rank, self.log, self.answers = rank, log, answers

    def __getattr__(self, name):
        return _Method(self, name)


@pytest.fixture
def no_ray(monkeypatch):
    import rollflow.infra.clients as clients

    monkeypatch.setattr(clients, "_get", lambda ref, timeout=None: ref)


def test_trainer_fans_collectives_out_to_every_rank_and_the_rest_to_rank_0(no_ray):
    from rollflow.infra.clients import TrainerClient

    log: list = []
    describe = {"backend": "torch", "rank": 0, "world_size": 2, "dp_backend": "gloo", "sharded": False}
    trainer = TrainerClient([_Actor(0, log, describe=describe), _Actor(1, log, describe=describe)])
    ref = {"root": "r", "run": "t", "split": "train", "rollout_id": 0}
    assert trainer.train_on_artifact(ref, dump_uri="d") == ("train_on_artifact", 0)  # rank 0's result
    assert [(r, m, kw["dump_uri"]) for r, m, _, _, kw in log] == [(0, "train_on_artifact", "d"),
                                                                  (1, "train_on_artifact", "d")]
    log.clear()
    trainer.load_artifact(ref)
    trainer.replay_step(ref, start_state_uri=None, out_state_uri="o")
    assert [(r, m) for r, m, *_ in log] == [(0, "load_artifact"), (1, "load_artifact"),
                                           (0, "replay_step"), (1, "replay_step")]
    log.clear()
    trainer.save_checkpoint(3, extra={"data": {}})
    trainer.named_weights()
    trainer.weight_checksums("bfloat16")
    # checkpoints reach every rank (a sharded trainer writes from all; the others return at once); weights: rank 0
    assert [(r, m) for r, m, *_ in log] == [(0, "save_checkpoint"), (1, "save_checkpoint"), (0, "describe"),
                                           (0, "named_weights"), (0, "weight_checksums")]
    # a sharded trainer (megatron tp / pp > 1): reading the weights is a collective, every rank is called
    log.clear()
    sharded = {**describe, "sharded": True}
    trainer = TrainerClient([_Actor(0, log, describe=sharded, export_weights={"w": 1}),
                             _Actor(1, log, describe=sharded, export_weights={})])
    assert trainer.named_weights().ref == {"w": 1}  # rank 0's gathered dict goes on to the engine
    assert trainer.weight_checksums(rank=1) == ("weight_checksums", 1)
    assert [(r, m) for r, m, *_ in log] == [(0, "describe"), (0, "export_weights"), (1, "export_weights"),
                                           (0, "weight_checksums"), (1, "weight_checksums")]


def test_engine_control_calls_run_in_the_control_group_and_results_are_typed(no_ray):
    from rollflow.infra.clients import EngineClient, EngineDescription, Pending
    from rollflow.infra.workers import CONTROL

    log: list = []
    engine = EngineClient(_Actor(0, log, abort=2, inflight=("a",), ping=True,
                                 describe={"backend": "hf", "model": "m", "weight_version": "3"},
                                 engine_checks={"mismatched": ["x"], "notes": []}, update_weights=4))
    assert engine.abort() == 2 and engine.inflight() == ["a"] and engine.alive()
    assert [(m, g) for _, m, g, _, _ in log] == [("abort", CONTROL), ("inflight", CONTROL), ("ping", CONTROL)]
    assert engine.describe() == EngineDescription("hf", "m", 3)
    assert engine.engine_checks(1).mismatched == ["x"]
    log.clear()
    # a Pending's ref goes to the actor as is (Ray resolves it there: weights go actor to actor)
    assert engine.update_weights(Pending("weights-ref"), 4) == 4
    assert log == [(0, "update_weights", None, ("weights-ref", 4), {})]


# -- the group ------------------------------------------------------------------------------------------
def test_worker_group_computes_the_placement_plan_once(tmp_path, monkeypatch):
    import rollflow.infra.placement as placement
    from rollflow.flows.group import WorkerGroup

    cfg = small_config(tmp_path, resources={"num_gpus": 4, "trainer_gpus": 1, "num_engines": 1,
                                            "gpus_per_engine": 2, "gpu_resource": "fake_gpu"})
    calls: list[int] = []
    real = placement.plan_placement
    monkeypatch.setattr(placement, "plan_placement", lambda *a, **k: calls.append(1) or real(*a, **k))
    group = WorkerGroup.for_run(cfg)
    assert [group.engine_base_gpu_id(0) for _ in range(3)] == [1, 1, 1]  # after trainer bundle 0
    assert group.plan is not None and group.plan.needed == 3 and len(calls) == 1
