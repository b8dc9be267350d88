"""Balancing policy: pure functions from measurements to plans (no processes, no tensors on devices)."""
