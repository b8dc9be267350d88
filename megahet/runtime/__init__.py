"""The runtime between steps: step hooks that measure, plan and apply, the measurement and the emulator.
Role: runtime.

- `hooks.py`: the StepHook interface the Trainer calls around every step;
- `balancer.py`: BalanceController (measure -> estimate speeds -> plan, with megahet/policy/);
- `resizer.py`: ResizeController (executes the plan through megahet/tensor_parallel/);
- `timing.py`: each rank's own compute (what the balancer reads);
- `devices.py`: virtual devices (emulation: they only slow a rank down);
- `trace_plot.py`: draws a balancer trace.
"""
