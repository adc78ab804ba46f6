"""Peak memory of the calling process: host RSS high-water mark and, with CUDA, the allocator's peak.

No psutil: `/proc/self/status` VmHWM on Linux, `resource.getrusage(RUSAGE_SELF).ru_maxrss` elsewhere.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def _vm_hwm_mb() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0  # kB
    except OSError:
        return None
    return None


def _ru_maxrss_mb() -> float | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024.0 * 1024.0) if sys.platform == "darwin" else peak / 1024.0  # bytes on macOS, kB else


def cuda_peak_mb() -> float | None:
    """Peak bytes the CUDA caching allocator handed out in this process (all devices), MB."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return sum(torch.cuda.max_memory_allocated(d) for d in range(torch.cuda.device_count())) / 2**20


def peak_memory() -> dict[str, Any]:
    hwm = _vm_hwm_mb()
    rss = hwm if hwm is not None else _ru_maxrss_mb()
    return {
        "pid": os.getpid(),
        "rss_peak_mb": rss,
        "rss_source": "VmHWM" if hwm is not None else "ru_maxrss",
        "cuda_peak_mb": cuda_peak_mb(),
    }
