"""How fast this machine page-locks host memory, and whether doing it off the main thread hides it (docs/performance.md
section 7: what is left of the first iteration on a fresh node is the trainer's first offload pinning its buffers).

    python -m benchmarks.pinned_host_alloc                 # torch's default pinned allocator (cudaHostAlloc)
    python -m benchmarks.pinned_host_alloc --register 8    # the same, each case in a fresh process with
        PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8

    python -m benchmarks.pinned_host_alloc --thp           # also with THP_MEM_ALLOC_ENABLE=1 (huge pages)

Per size: the seconds of one fresh pinned allocation (sizes not a power of two, so torch's pinned cache, which
rounds each block up to one, cannot serve a later size from an earlier block) and a device-to-host copy into it;
then the same size on a `HostShelf` (rollflow.tasks.pinned: exact size, pages touched on all cores, then
registered), its two steps timed apart. Then a loop of bf16 matmuls on the GPU alone, and again while another
thread pins 4 x 3 GiB, torch's way and the shelf's: the slowdown says whether the allocation can hide behind GPU
work in the same process. Writes benchmarks/results/<machine>-<date>-pinned-host-alloc.json. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

GIB = 1 << 30
ODD = 4097  # bytes past a whole GiB: no earlier block of the cache fits exactly


def measure(sizes_gib: list[int]) -> dict:
    """One process: fresh allocations of each size, then the overlap probe."""
    import torch

    torch.empty(1, device="cuda")  # the context first: its start is not an allocation
    rows = []
    for n in sizes_gib:
        started = time.perf_counter()
        host = torch.empty(n * GIB + ODD, dtype=torch.uint8, pin_memory=True)
        alloc_s = time.perf_counter() - started
        assert host.is_pinned()
        device = torch.empty(n * GIB + ODD, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        started = time.perf_counter()
        host.copy_(device, non_blocking=True)
        torch.cuda.synchronize()
        copy_s = time.perf_counter() - started
        del host
        shelf_row = shelf_alloc(n * GIB + ODD)
        buffer = shelf_row.pop("buffer")
        shelf_d2h = []
        for _ in range(2):  # the first copy into registered memory may pay for mapping it on the GPU side
            started = time.perf_counter()
            buffer.copy_(device, non_blocking=True)
            torch.cuda.synchronize()
            shelf_d2h.append(time.perf_counter() - started)
        shelf_row.pop("shelf")
        del buffer
        rows.append(
            {
                "gib": n,
                "alloc_s": alloc_s,
                "alloc_gib_s": n / alloc_s,
                "d2h_gib_s": n / copy_s,
                **{f"shelf_{k}": v for k, v in shelf_row.items()},
                "shelf_gib_s": n / shelf_row["s"],
                "shelf_d2h_gib_s": n / shelf_d2h[0],
                "shelf_d2h_again_gib_s": n / shelf_d2h[1],
            }
        )
        del device

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def gpu_loop(k: int = 1000) -> float:
        started = time.perf_counter()
        for _ in range(k):
            a @ a
        torch.cuda.synchronize()
        return time.perf_counter() - started

    gpu_loop(20)
    alone = gpu_loop()
    held: list = []
    took: dict[str, float] = {}

    def pin_in_background() -> None:
        started = time.perf_counter()
        for _ in range(4):
            held.append(torch.empty(3 * GIB + ODD + len(held), dtype=torch.uint8, pin_memory=True))
        took["s"] = time.perf_counter() - started

    thread = threading.Thread(target=pin_in_background)
    thread.start()
    beside = gpu_loop()
    thread.join()
    held.clear()

    def shelf_in_background() -> None:
        started = time.perf_counter()
        for k in range(4):
            held.append(shelf_alloc(3 * GIB + ODD + k))
        took["shelf_s"] = time.perf_counter() - started

    thread = threading.Thread(target=shelf_in_background)
    thread.start()
    beside_shelf = gpu_loop()
    thread.join()
    return {
        "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"),
        "sizes": rows,
        "gpu_loop_alone_s": alone,
        "gpu_loop_beside_background_pinning_s": beside,
        "background_pinning_12gib_s": took["s"],
        "slowdown": beside / alone,
        "gpu_loop_beside_background_shelf_s": beside_shelf,
        "background_shelf_12gib_s": took["shelf_s"],
        "shelf_slowdown": beside_shelf / alone,
    }


def shelf_alloc(nbytes: int) -> dict:
    """One fresh `HostShelf` buffer of `nbytes`: the seconds of the whole, of touching the pages (the zero fill
    on all cores) and of registering them, apart; the buffer under "buffer"."""
    import torch

    from rollflow.tasks.pinned import HostShelf, _register, page_locked

    like = torch.empty(nbytes, dtype=torch.uint8, device="meta")
    started = time.perf_counter()
    shelf = HostShelf()  # kept with the buffer: a dropped shelf unregisters its memory
    buffer = shelf.place({"x": like})["x"]
    whole = time.perf_counter() - started
    assert page_locked(buffer)
    # the two steps apart, on a second buffer of the same size
    plain = HostShelf(pin=False).place({"x": like})["x"]
    started = time.perf_counter()
    plain.zero_()
    touch = time.perf_counter() - started
    started = time.perf_counter()
    _register(plain)
    register = time.perf_counter() - started
    return {"s": whole, "touch_s": touch, "register_s": register, "buffer": buffer, "shelf": shelf}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,3,12", help="GiB per fresh allocation, comma-separated")
    ap.add_argument("--register", type=int, nargs="*", default=[], help="also run with N host-register threads")
    ap.add_argument("--thp", action="store_true", help="also run with THP_MEM_ALLOC_ENABLE=1 (huge pages)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.child:
        print(json.dumps(measure(sizes)))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("pinned_host_alloc: needs a CUDA device (pinned host memory is a CUDA allocation)", file=sys.stderr)
        return 2
    from benchmarks.core import default_out, machine_info, versions, write_json

    confs = [("default", {})] + [
        (
            f"register {n}",
            {"PYTORCH_CUDA_ALLOC_CONF": f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{n}"},
        )
        for n in args.register
    ]
    if args.thp:
        confs.append(("huge pages", {"THP_MEM_ALLOC_ENABLE": "1"}))
    cases = []
    for name, extra in confs:  # the allocator reads its settings once per process
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        env.update(extra)
        cmd = [sys.executable, "-m", "benchmarks.pinned_host_alloc", "--child", "--sizes", args.sizes]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        case = {"case": name, "env": extra, **json.loads(out.strip().splitlines()[-1])}
        cases.append(case)
        sizes_line = ", ".join(
            f"{r['gib']} GiB {r['alloc_s']:.2f} s ({r['alloc_gib_s']:.1f} GiB/s; shelf {r['shelf_s']:.2f} s = "
            f"touch {r['shelf_touch_s']:.2f} + register {r['shelf_register_s']:.2f})"
            for r in case["sizes"]
        )
        print(
            f"{name}: {sizes_line}; GPU loop {case['gpu_loop_alone_s']:.2f} s alone, "
            f"{case['gpu_loop_beside_background_pinning_s']:.2f} s beside 12 GiB pinned in a thread "
            f"({case['slowdown']:.2f}x), {case['gpu_loop_beside_background_shelf_s']:.2f} s beside 12 GiB shelved "
            f"({case['shelf_slowdown']:.2f}x)"
        )
    stem = default_out("cuda")
    path = args.out or stem.with_name(f"{stem.stem}-pinned-host-alloc.json")
    write_json({"machine": machine_info(), "versions": versions(), "cases": cases}, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
