"""Run a training script with this rank on one core, pinned after its heavy imports (a test worker).

    torchrun --nproc_per_node 4 workers/one_core_after_import.py CORE SCRIPT [ARGS...]

torch, megatron-core and DeepSpeed import on every core the launcher may use (four ranks importing on one
core would take four times as long); then the rank moves to CORE, and the script trains there, sharing
it with the other ranks (test_device_emulation.py).
"""

from __future__ import annotations

import os
import runpy
import sys

import megahet.training  # noqa: F401  (the heavy imports)

if __name__ == "__main__":
    core, script, *args = sys.argv[1:]
    os.sched_setaffinity(0, {int(core)})
    print(f"rank {os.environ['RANK']} trains on cores {sorted(os.sched_getaffinity(0))}", flush=True)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
