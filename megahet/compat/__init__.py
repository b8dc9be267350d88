"""Every use of another library's private API, in one folder (role: compatibility).

megahet extends megatron-core, DeepSpeed and torch.distributed through their public seams where they
have one. Where it must reach further (a DeepSpeed attribute, a file layout, a megatron-core name), the
reach lives here, and `tests/unit/test_compat.py` checks that the installed versions still have what it
relies on, failing with a line that names it: a version bump then fails in one clear test, not deep
inside training.

- `deepspeed_checkpoint.py`: the types DeepSpeed pickles into its checkpoint files, and the loads
  DeepSpeed and its zero_to_fp32 make, routed through megahet's safe loader.
"""
