"""Every use of another library's private API, in one folder (role: compatibility).

megahet extends megatron-core, DeepSpeed and torch.distributed through their public seams where they
have one. Where it must reach further (a DeepSpeed attribute, a file layout, a megatron-core name), the
reach lives here, and `tests/unit/test_compat.py` checks that the installed versions still have what it
relies on, failing with a line that names it: a version bump then fails in one clear test, not deep
inside training.

- `deepspeed_checkpoint.py`: the types DeepSpeed pickles into its checkpoint files, and the loads
  DeepSpeed and its zero_to_fp32 make, routed through megahet's safe loader;
- `deepspeed_zero.py`: ZeRO-1/2's per-parameter fp32 and Adam fragments, its optimizer file layout,
  and the flag of pipeline copies in its gradient norm;
- `collectives.py`: torch.distributed's collectives (and megatron-core's own bindings of two of them)
  wrapped for the length of a training step, for the clock;
- `megatron_timers.py`: the names of megatron-core's compute timers the clock opens its regions on;
- `cpu_shims.py`: the megatron-core and DeepSpeed calls that assume CUDA, replaced on CPU only.

Nothing outside this folder touches another library's private names; `cpu_shims` and `collectives`
are the only modules that replace anything, the first on CPU only and the second within a step.
"""
