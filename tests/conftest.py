"""Shared fixtures of the unit tests.

`world1`: a one-rank gloo world with megatron-core's groups (TP = PP = DP = 1) and DeepSpeed's comm,
seeded with the test module's `SEED` (default 1234); torn down when the module's tests are done.
"""

from __future__ import annotations

import pytest

from megahet.launch import free_port


@pytest.fixture(scope="module")
def world1(request):
    import deepspeed

    from megahet.parallel import destroy_parallel, initialize_parallel

    with pytest.MonkeyPatch.context() as mp:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0"}
        for key, value in {**env, "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
            mp.setenv(key, value)
        layout = initialize_parallel(tp=1, pp=1, seed=getattr(request.module, "SEED", 1234))
        deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        try:
            yield layout
        finally:
            destroy_parallel()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a CUDA device: skipped (with the reason) on CPU machines and in CI."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
