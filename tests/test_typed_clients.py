"""flows/ reaches its actors only through the typed clients (rollflow.infra.clients), built by the
run's WorkerGroup (issue 15, part 2): no method names in strings, every client method calls an
operation the worker really has, data-parallel fan-out and the control group live in the clients,
and the placement plan is computed once per group. No Ray cluster needed."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from tests.conftest import small_config

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("flows", "infra")  # the orchestrator's side: it reaches actors only through typed calls
# `.call("rollout", ...)`, `.submit('named_weights')`, `.control("abort")`: a method name as the first argument
STRING_DISPATCH = re.compile(r"""\.(?:call|submit|control)\(\s*f?["']""")
# What an actor handle looks like in source: `self.actor`, `self.ranks[r]`, `handle`, or a name bound from one
# (`for a in self.ranks`, `actor = group.actor`).
HANDLE = re.compile(r"\bactors?\b|\b_?ranks\b|\bhandles?\b")


def _worker_operations() -> set[str]:
    """The public method names of every actor class: a string equal to one is a method name in a string."""
    from rollflow.tasks.rollout.sglang.server_worker import SGLangServerWorker
    from rollflow.tasks.rollout.worker import RolloutWorker
    from rollflow.tasks.train.critic_worker import CriticWorker
    from rollflow.tasks.train.worker import TrainWorker

    return {
        name
        for cls in (TrainWorker, RolloutWorker, SGLangServerWorker, CriticWorker)
        for name in vars(cls)
        if not name.startswith("_") and callable(getattr(cls, name))
    }


def _handle_names(tree: ast.AST) -> set[str]:
    """Names bound to actor handles: loop / comprehension targets over, and assignments from, handle expressions."""
    names: set[str] = set()
    for node in ast.walk(tree):
        pairs = []
        if isinstance(node, (ast.For, ast.comprehension)):
            pairs.append((node.target, node.iter))
        elif isinstance(node, ast.Assign):
            pairs += [(t, node.value) for t in node.targets]
        for target, value in pairs:
            if HANDLE.search(ast.unparse(value)):
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def _is_handle(node: ast.expr, handles: set[str]) -> bool:
    return (isinstance(node, ast.Name) and node.id in handles) or bool(HANDLE.search(ast.unparse(node)))


def dispatch_hits(source: str, operations: set[str]) -> list[tuple[int, str]]:
    """(line, why) of every actor call by name in `source`: a method name in a string passed to a dispatcher or
    to a helper on `self` / a handle (`self._on(0, "weight_prefixes")`), or `getattr(handle, anything)`."""
    hits = [
        (n, "method name in a string")
        for n, line in enumerate(source.splitlines(), start=1)
        if STRING_DISPATCH.search(line)
    ]
    tree = ast.parse(source)
    handles = _handle_names(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (
            isinstance(func, ast.Name)
            and func.id in ("getattr", "hasattr")
            and node.args
            and _is_handle(node.args[0], handles)
        ):
            hits.append((node.lineno, f"{func.id} on an actor handle"))
        elif isinstance(func, ast.Attribute) and (_is_handle(func.value, handles) or ast.unparse(func.value) == "self"):
            named = [a.value for a in node.args if isinstance(a, ast.Constant) and a.value in operations]
            if named:
                hits.append((node.lineno, f"operation {named[0]!r} named in a string"))
    return sorted(set(hits))


def string_dispatches(
    roots: list[Path], base: Path = REPO, operations: set[str] | None = None
) -> tuple[list[str], int]:
    """`file:line: code (why)` of every actor call by name in the .py files under `roots`, and the files read."""
    operations = _worker_operations() if operations is None else operations
    hits, files = [], 0
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            files += 1
            source = path.read_text()
            lines = source.splitlines()
            for n, why in dispatch_hits(source, operations):
                hits.append(f"{path.relative_to(base)}:{n}: {lines[n - 1].strip()}  ({why})")
    return hits, files


def test_flows_and_infra_call_no_actor_method_by_name():
    hits, files = string_dispatches([REPO / folder for folder in SCANNED])
    assert files >= 20, f"the scan read only {files} files under {SCANNED}: did the folders move?"
    assert not hits, (
        "flows/ or infra/ calls actor methods by name; call them as attributes through the typed "
        "clients (rollflow.infra.clients, through flows/group.py:WorkerGroup):\n" + "\n".join(hits)
    )


def test_the_scan_catches_string_dispatch(tmp_path):
    (tmp_path / "flows").mkdir()
    (tmp_path / "infra").mkdir()
    (tmp_path / "flows" / "bad.py").write_text(
        "x = 1\nengine.call(\"rollout\", 0)\ntrainer.submit('named_weights')\n"
        'h.control("abort")\ngetattr(self.actor, "ping")\nengine.rollout(0)\n'
    )
    (tmp_path / "infra" / "bad.py").write_text(
        "class C:\n"
        "    def _on(self, rank, method):\n"
        "        return getattr(self.ranks[rank], method).remote()\n"  # 3: getattr on a handle, name in a variable
        "    def f(self):\n"
        '        return self._on(0, "weight_prefixes")\n'  # 5: an operation's name handed to a helper
        "    def g(self, method):\n"
        "        return [getattr(a, method).remote() for a in self.ranks]\n"  # 7: a handle bound by a loop
        "    def ok(self, data, key):\n"
        '        reporting.stage("rollout")\n'  # not a dispatch: a stage label equal to an operation's name
        "        return getattr(data, key), self.ranks[0].weight_prefixes.remote(4)\n"
    )
    hits, files = string_dispatches(
        [tmp_path / "flows", tmp_path / "infra"],
        base=tmp_path,
        operations={"rollout", "named_weights", "ping", "weight_prefixes"},
    )
    assert files == 2
    assert [h.split(": ", 1)[0] for h in hits] == [
        "flows/bad.py:2",
        "flows/bad.py:3",
        "flows/bad.py:4",
        "flows/bad.py:5",
        "infra/bad.py:3",
        "infra/bad.py:5",
        "infra/bad.py:7",
    ]


# -- declared capabilities: the worker classes ask `isinstance(engine, Abortable)`, never probe names ------
def _worker_classes() -> list[type]:
    from rollflow.tasks.rollout.worker import RolloutWorker
    from rollflow.tasks.train.critic_worker import CriticWorker
    from rollflow.tasks.train.worker import TrainWorker

    return [RolloutWorker, TrainWorker, CriticWorker]


def name_probes(source: str, classes: set[str]) -> tuple[list[str], set[str]]:
    """`Class:line: code` of every getattr / hasattr call inside the named classes of `source`, and the classes
    found. A capability is a protocol asked with isinstance; the worker's own state is a plain attribute."""
    hits, found = [], set()
    for cls in ast.walk(ast.parse(source)):
        if not (isinstance(cls, ast.ClassDef) and cls.name in classes):
            continue
        found.add(cls.name)
        for node in ast.walk(cls):
            func = node.func if isinstance(node, ast.Call) else None
            if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr"):
                hits.append(f"{cls.name}:{node.lineno}: {ast.unparse(node)}")
    return hits, found


def test_worker_classes_probe_no_capability_by_name():
    hits, found = [], set()
    for cls in _worker_classes():
        more, seen = name_probes(Path(inspect.getsourcefile(cls)).read_text(), {cls.__name__})
        hits += more
        found |= seen
    assert found == {c.__name__ for c in _worker_classes()}, f"the scan found only {sorted(found)}"
    assert not hits, (
        "the worker classes probe capabilities by name; declare them as protocols "
        "(tasks/rollout/capabilities.py, tasks/train/capabilities.py) and ask with isinstance:\n" + "\n".join(hits)
    )


def test_the_probe_scan_catches_getattr_and_hasattr():
    source = (
        "class W:\n"
        "    def a(self):\n"
        '        if hasattr(self.engine, "reset_abort"):\n'  # 3
        "            self.engine.reset_abort()\n"
        '        move = getattr(self.backend, "offload", None)\n'  # 5
        '        loaded = getattr(self, "_loaded", None)\n'  # 6: a self-state hack
        "        return isinstance(self.engine, Abortable)\n"
        "def helper(x):\n"
        '    return getattr(x, "y", None)\n'
    )  # outside the scanned class
    hits, found = name_probes(source, {"W"})
    assert found == {"W"} and [h.split(": ", 1)[0] for h in hits] == ["W:3", "W:5", "W:6"]


def _members(protocol: type) -> set[str]:
    """A protocol's members: its annotated attributes and the methods of its body."""
    return set(protocol.__dict__.get("__annotations__", {})) | {
        name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")
    }


def test_engines_and_backends_declare_their_capabilities(tmp_path):
    """The protocols are structural: the real engines and backends conform without inheriting from them, and
    each has exactly the capabilities the worker used to find by name (behaviour unchanged)."""
    from rollflow.tasks.rollout import capabilities as rc
    from rollflow.tasks.rollout.settings import RolloutConfig
    from rollflow.tasks.rollout.sglang.engine import SGLangEngine
    from rollflow.tasks.rollout.worker import build_engine
    from rollflow.tasks.sync.capabilities import HoldsModule, ResidentTensors
    from rollflow.tasks.train import capabilities as tc
    from rollflow.tasks.train.megatron.backend import MegatronBackend
    from rollflow.tasks.train.settings import OptimConfig
    from rollflow.tasks.train.worker import build_backend

    def protocols(module) -> list[type]:
        return [p for p in vars(module).values() if isinstance(p, type) and p.__module__ == module.__name__]

    rollout_caps, train_caps = protocols(rc), protocols(tc)
    assert len(rollout_caps) >= 9 and len(train_caps) >= 4
    hf, _ = build_engine("builtin:addition", RolloutConfig())
    sglang = SGLangEngine(["http://127.0.0.1:9"], weight_sync="tensor")  # no request is made
    torch_backend = build_backend("builtin:addition", OptimConfig(), temperature=1.0)
    expected = [
        (
            hf,
            rollout_caps,
            {
                rc.Abortable,
                rc.StickyAbort,
                ResidentTensors,
                HoldsModule,
                rc.BucketedWeightSync,
                rc.TakesBuckets,
                rc.WeightUpdateSession,
            },
        ),
        (
            sglang,
            rollout_caps,
            {
                rc.Liveness,
                rc.Abortable,
                rc.ReportsInflight,
                rc.Offloadable,
                rc.ServesWeightsByName,
                rc.ReportsModelInfo,
                rc.BucketedWeightSync,
                rc.WeightUpdateSession,
                rc.WeightGroupMember,
            },
        ),
        (
            torch_backend,
            train_caps,
            {tc.Offloadable, tc.KnowsVocabSize, tc.ModuleReference, ResidentTensors, HoldsModule},
        ),
    ]
    for obj, caps, wanted in expected:
        has = {p for p in [*caps, ResidentTensors, HoldsModule] if isinstance(obj, p)}
        assert has == wanted, f"{type(obj).__name__}: has {sorted(p.__name__ for p in has)}"
    # megatron-core is not needed to see the class's members (its constructor would need it)
    for protocol in (tc.Sharded, tc.Offloadable, tc.BucketExporter, tc.HostReference):
        missing = _members(protocol) - set(dir(MegatronBackend))
        assert not missing, f"MegatronBackend lacks {sorted(missing)} of {protocol.__name__}"
    assert not (_members(ResidentTensors) | _members(tc.KnowsVocabSize)) & set(dir(MegatronBackend))
    # instance attributes: `model` is set by the constructor, `ref_model` never (its reference is a host copy)
    init = inspect.getsource(MegatronBackend.__init__)
    assert "self.model = " in init and "ref_model" not in inspect.getsource(MegatronBackend)


def _remote_calls_by_class(source: str) -> dict[str, set[str]]:
    """Per class of infra/clients.py, the actor methods it calls (`<x>.NAME.remote(` / `.NAME.options(`)."""
    out: dict[str, set[str]] = {}
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        names = out.setdefault(cls.name, set())
        for node in ast.walk(cls):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("remote", "options")
                and isinstance(node.value, ast.Attribute)
            ):
                names.add(node.value.attr)
    return out


def test_every_client_method_calls_an_operation_the_worker_has():
    from rollflow.tasks.rollout.sglang.server_worker import SGLangServerWorker
    from rollflow.tasks.rollout.worker import RolloutWorker
    from rollflow.tasks.train.critic_worker import CriticWorker
    from rollflow.tasks.train.worker import TrainWorker

    workers = {
        "TrainerClient": TrainWorker,
        "EngineClient": RolloutWorker,
        "ServerClient": SGLangServerWorker,
        "CriticClient": CriticWorker,
    }
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
    import dataclasses

    from rollflow.artifacts.store import ArtifactRef
    from rollflow.infra.clients import BroadcastBucket, TrainerClient, TrainerDescription

    log: list = []
    describe = TrainerDescription(backend="torch", rank=0, world_size=2, dp_backend="gloo", sharded=False)
    trainer = TrainerClient([_Actor(0, log, describe=describe), _Actor(1, log, describe=describe)])
    ref = ArtifactRef("/r", "t", "train", 0)
    assert trainer.train_on_artifact(ref, dump_uri="d") == ("train_on_artifact", 0)  # rank 0's result
    assert [(r, m, kw["dump_uri"]) for r, m, _, _, kw in log] == [
        (0, "train_on_artifact", "d"),
        (1, "train_on_artifact", "d"),
    ]
    assert all(args == (ref,) for *_, args, _ in log)  # the dataclass itself goes to the workers (Ray pickles it)
    log.clear()
    trainer.load_artifact(ref)
    trainer.replay_step(ref, start_state_uri=None, out_state_uri="o")
    assert [(r, m) for r, m, *_ in log] == [
        (0, "load_artifact"),
        (1, "load_artifact"),
        (0, "replay_step"),
        (1, "replay_step"),
    ]
    log.clear()
    trainer.save_checkpoint(3, extra={"data": {}})
    trainer.named_weights()
    trainer.weight_checksums("bfloat16")
    # checkpoints reach every rank (a sharded trainer writes from all; the others return at once); weights: rank 0
    assert [(r, m) for r, m, *_ in log] == [
        (0, "save_checkpoint"),
        (1, "save_checkpoint"),
        (0, "describe"),
        (0, "named_weights"),
        (0, "weight_checksums"),
    ]
    # a sharded trainer (megatron tp / pp > 1): reading the weights is a collective, every rank is called
    log.clear()
    sharded = dataclasses.replace(describe, sharded=True)
    trainer = TrainerClient(
        [_Actor(0, log, describe=sharded, export_weights={"w": 1}), _Actor(1, log, describe=sharded, export_weights={})]
    )
    assert trainer.named_weights().ref == {"w": 1}  # rank 0's gathered dict goes on to the engine
    assert trainer.weight_checksums(rank=1) == ("weight_checksums", 1)
    assert [(r, m) for r, m, *_ in log] == [
        (0, "describe"),
        (0, "export_weights"),
        (1, "export_weights"),
        (0, "weight_checksums"),
        (1, "weight_checksums"),
    ]
    # the broadcast path's steps reach every rank too (a sharded trainer's ranks make each bucket together)
    log.clear()
    bucket = BroadcastBucket(metas=[{"name": "w", "dtype": "float32", "shape": (2,)}], last=True)
    trainer = TrainerClient([_Actor(r, log, describe=sharded, next_weight_bucket=bucket) for r in (0, 1)])
    trainer.weight_buckets_begin(1024, "bfloat16")
    assert trainer.next_weight_bucket() == (bucket.metas, True)
    assert trainer.weight_prefixes(4) == ("weight_prefixes", 0)
    assert [(r, m, args) for r, m, _, args, _ in log] == [
        (0, "describe", ()),
        (0, "weight_buckets_begin", (1024, "bfloat16")),
        (1, "weight_buckets_begin", (1024, "bfloat16")),
        (0, "next_weight_bucket", ()),
        (1, "next_weight_bucket", ()),
        (0, "weight_prefixes", (4, None)),
        (1, "weight_prefixes", (4, None)),
    ]


def test_engine_control_calls_run_in_the_control_group_and_results_are_typed(no_ray):
    from rollflow.infra.clients import EngineChecks, EngineClient, EngineDescription, Pending
    from rollflow.infra.workers import CONTROL

    log: list = []
    engine = EngineClient(
        _Actor(
            0,
            log,
            abort=2,
            inflight=("a",),
            ping=True,
            describe=EngineDescription("hf", "m", 3),
            engine_checks=EngineChecks(mismatched=["x"], notes=[]),
            update_weights=4,
        )
    )
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
    import rollflow.flows.group as group_module
    from rollflow.flows.group import WorkerGroup

    cfg = small_config(
        tmp_path,
        resources={
            "num_gpus": 4,
            "trainer_gpus": 1,
            "num_engines": 1,
            "gpus_per_engine": 2,
            "gpu_resource": "fake_gpu",
        },
    )
    calls: list[int] = []
    real = group_module.plan_placement
    monkeypatch.setattr(group_module, "plan_placement", lambda *a, **k: calls.append(1) or real(*a, **k))
    group = WorkerGroup.for_run(cfg)
    assert [group.engine_base_gpu_id(0) for _ in range(3)] == [1, 1, 1]  # after trainer bundle 0
    assert group.plan is not None and group.plan.needed == 3 and len(calls) == 1
