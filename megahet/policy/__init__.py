"""The balancing policy: pure functions from measurements to plans (no processes). Role: policy.

One exception to "no tensors": `selection.GradientStats` keeps per-unit gradient statistics on the
gradients' device, so that folding a step's gradients in costs no copy to the host.
"""
