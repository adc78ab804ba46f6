"""Model dtypes by config name (`rollout.dtype`, `train.dtype`, sync casts): one table for the
rollout engine, the trainers and the weight sync."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
