"""The names of megatron-core's compute timers, which megahet's clock opens its regions on (private API).

megatron-core's pipeline schedules call `config.timers(name, log_level=2).start()` / `.stop()` around
each micro-batch's forward and backward compute. megahet's `ComputeTimers` (megahet/runtime/timing.py)
is that `config.timers`: it times exactly the regions named here and ignores every other name. A renamed
timer would silently time nothing, so tests/unit/test_compat.py checks that the installed schedules
still use these names.
"""

from __future__ import annotations

COMPUTE_REGIONS = ("forward-compute", "backward-compute")
"""megatron-core's timer names around a micro-batch's forward and backward compute."""
