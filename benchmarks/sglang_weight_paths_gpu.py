"""GPU check of the trainer-side mechanics of two SGLang weight paths, without SGLang (it cannot be
installed on the machines here). Needs torch and CUDA GPUs: 2 for the NCCL check, 1 for the IPC one.

1. distributed (NCCL): `init_weight_group` (tasks/sync/weight_group.py) on both sides: rank 0 =
   trainer on GPU 0, rank 1 = a stand-in for an SGLang engine on GPU 1 that joins the group exactly
   as SGLang's `init_weights_update_group` does (tcp:// rendezvous, store prefixed by the group name)
   and receives each tensor by name/dtype/shape metadata, as `update_weights_from_distributed` does.
2. tensor (CUDA IPC): `serialize_named_tensors` of CUDA tensors on GPU 0, base64 as in the
   `/update_weights_from_tensor` body, deserialized in another process (SGLang's scheduler does the
   same with its `MultiprocessingSerializer`) -- the data is read through the IPC handle, not copied.

    python benchmarks/sglang_weight_paths_gpu.py
"""

from __future__ import annotations

import base64
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollflow.tasks.rollout.sglang.payloads import serialize_named_tensors, torch_dtype_name  # noqa: E402
from rollflow.tasks.sync.weight_group import init_weight_group  # noqa: E402


def engine_side(port: int, inbox, outbox, nccl: bool) -> None:
    import torch.distributed as dist

    pg = None
    if nccl:
        torch.cuda.set_device(1)
        pg = init_weight_group(
            "127.0.0.1", port, rank=1, world_size=2, group_name="rollflow_weight_sync", backend="nccl"
        )
        metas = inbox.get()
        sums = []
        for _name, dtype, shape in metas:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device="cuda:1")
            dist.broadcast(t, src=0, group=pg)
            sums.append(float(t.double().sum()))
        torch.cuda.synchronize()
        outbox.put(sums)
    payload = inbox.get()
    from rollflow.tasks.sync.ipc import deserialize_named_tensors

    # CUDA IPC handles (device named by UUID) -> tensors on the producer's GPU
    named = deserialize_named_tensors(base64.b64decode(payload))
    outbox.put([(n, float(t.double().sum()), str(t.device), t.data_ptr() != 0) for n, t in named])
    inbox.get()  # hold the handles until the producer says done
    if pg is not None:
        dist.destroy_process_group(pg)


def main() -> int:
    gpus = torch.cuda.device_count()
    if gpus < 1:
        print("needs a CUDA GPU")
        return 2
    nccl = gpus >= 2
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = ctx.Process(target=engine_side, args=(port, inbox, outbox, nccl))
    proc.start()
    torch.cuda.set_device(0)
    import torch.distributed as dist

    g = torch.Generator(device="cuda:0").manual_seed(0)
    named = {
        "model.embed_tokens.weight": torch.randn(32000, 2048, device="cuda:0", generator=g).bfloat16(),
        "model.layers.0.mlp.up_proj.weight": torch.randn(5632, 2048, device="cuda:0", generator=g).bfloat16(),
        "model.norm.weight": torch.ones(2048, device="cuda:0", dtype=torch.float32),
    }
    want = [float(t.double().sum()) for t in named.values()]
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    ok = True
    if nccl:
        pg = init_weight_group(
            "127.0.0.1", port, rank=0, world_size=2, group_name="rollflow_weight_sync", backend="nccl"
        )
        inbox.put([(n, torch_dtype_name(t.dtype), list(t.shape)) for n, t in named.items()])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for t in named.values():
            dist.broadcast(t, src=0, group=pg)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        got = outbox.get(timeout=120)
        print(
            f"nccl broadcast: {len(named)} tensors, {nbytes / 2**20:.0f} MiB in {dt * 1e3:.1f} ms "
            f"({nbytes / dt / 2**30:.1f} GiB/s incl. first-call setup); sums equal: {got == want}"
        )
        ok = got == want
    else:
        print("nccl broadcast: skipped (1 GPU; NCCL needs one GPU per rank)")
    payload = base64.b64encode(serialize_named_tensors(list(named.items()))).decode()
    inbox.put(payload)
    ipc = outbox.get(timeout=120)
    print(
        f"cuda ipc: payload {len(payload)} base64 chars for {nbytes / 2**20:.0f} MiB of tensors; "
        f"received {[(n, d) for n, _, d, _ in ipc]}; sums equal: {[s for _, s, _, _ in ipc] == want}"
    )
    inbox.put("done")
    proc.join(60)
    if nccl:
        dist.destroy_process_group(pg)
    ok = ok and [s for _, s, _, _ in ipc] == want and len(payload) < 100_000
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
