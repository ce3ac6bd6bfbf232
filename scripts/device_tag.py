"""Print the tag the GPU scripts put in their output files' names: the current CUDA device's (h200, h100, a100, ...;
`benchmarks._common.device_tag`), or "cpu" without CUDA or with DEVICE=cpu. $GPU_TAG, when set, wins."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import device_tag  # noqa: E402


def main() -> str:
    if os.environ.get("GPU_TAG"):
        return device_tag(os.environ["GPU_TAG"])
    if os.environ.get("DEVICE", "cuda").startswith("cpu"):
        return "cpu"
    import torch

    return device_tag(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    print(main())
