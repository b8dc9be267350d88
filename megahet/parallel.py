"""Process groups for TP x PP x DP over megatron-core, and the DeepSpeed `mpu` adapter.

Role: runtime (process groups).

Glossary: we say *TP group* for the ranks that split one layer's matmuls, *PP stage* for the ranks
that hold one slice of the layers, *CP group* for the ranks that split each sequence (parallel.cp),
*DP replica* for a full copy of the model (its CP ranks hold the same weights), and *model parallel
group* for the TP x PP ranks of one DP replica (what DeepSpeed calls "model parallel").

    layout = initialize_parallel(tp=2, pp=2, seed=1234)   # after torchrun / deepspeed set env
    engine, *_ = deepspeed.initialize(..., mpu=MegatronMpu())

Works under `torchrun`, the `deepspeed` launcher, and plain `python` (one rank, a local store).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from megahet.compat.cpu_shims import apply_cpu_shims
from megahet.config import ConfigError
from megahet.platform import cuda_available, device, distributed_backend
from megahet.policy.mesh import STRIDED_ORDER, coords_of


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Where this rank sits in the TP x PP x DP grid."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    stage_layers: tuple[int, ...] | None = None
    """Layers per pipeline stage of the run (its plan's split, megahet/run_plan.py); None: as the
    configuration gives them (parallel.stage_layers, or even)."""
    cp_rank: int = 0
    cp_size: int = 1
    """Context parallelism: this rank's place among the ranks that split each sequence (parallel.cp)."""
    strided: bool = False
    """TP groups strided over the ranks (megatron-core's order STRIDED_ORDER, megahet/policy/mesh.py): an
    escalation's placement of late ranks in one TP group."""
    weights_loaded: bool = False
    """Every weight of this rank's stage is overwritten right after the build by a loaded or moved state
    (a resume, a re-split, an elastic restart): the model builders then skip initializing them
    (megatron-core's `perform_initialization=False`; megahet/models/common.py `mark_tensor_parallel_weights`
    marks the TP weights' partitions as the skipped path would), the CPU work of a stage's build that grows
    with it."""

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_logging_rank(self) -> bool:
        """The rank that prints and logs: TP rank 0 and CP rank 0 of DP replica 0 on the last stage."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.dp_rank == 0 and self.is_last_stage


def check_world_size(world_size: int, tp: int, pp: int, cp: int = 1) -> int:
    """Return the DP size, or raise a one-line ConfigError when TP x PP (x CP) does not divide the world
    (the one copy of this check: config validation and initialize_parallel both call it)."""
    if tp < 1 or pp < 1 or cp < 1:
        raise ConfigError(
            f"tensor/pipeline/context parallel sizes must be >= 1 (got tp={tp}, pp={pp}, cp={cp})"
        )
    if world_size % (tp * pp * cp) != 0:
        dims = [("TP", tp), ("PP", pp)] + ([("CP", cp)] if cp > 1 else [])  # CP named only where it is used
        names, sizes = "*".join(n for n, _ in dims), "*".join(str(v) for _, v in dims)
        flags = " / ".join(f"--parallel.{n.lower()}" for n, _ in dims)
        raise ConfigError(
            f"world size {world_size} is not divisible by {names} = {sizes} = {tp * pp * cp}: "
            f"launch a multiple of {tp * pp * cp} ranks or change {flags}"
        )
    return world_size // (tp * pp * cp)


def mesh_coords(
    world_size: int, tp: int, pp: int, strided: bool = False, cp: int = 1
) -> list[tuple[int, int, int]]:
    """(dp, pp, tp) of every global rank as megatron-core lays the mesh out (its default order
    "tp-cp-ep-dp-pp": TP fastest, then CP, then DP, then PP; `strided`: DP fastest), known before any
    process group starts; the `cp` CP ranks of a position share its coordinates."""
    dp = check_world_size(world_size, tp, pp, cp)
    return [coords_of(rank, tp, dp, strided, cp) for rank in range(world_size)]


def _init_process_group(timeout_minutes: int) -> None:
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:  # plain `python script.py`: a single rank
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if cuda_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store = _elastic_attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend=distributed_backend(), timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        backend=distributed_backend(), store=store, rank=rank, world_size=world, timeout=timeout
    )


def _elastic_attempt_store(timeout: datetime.timedelta):
    """Under torchrun after a restart, the agent's store with a key space of this attempt's own.

    torchrun's c10d rendezvous hands the workers of every attempt the same TCPStore (the agent's
    `_shared_tcp_store_server`), so the keys the previous attempt's ranks wrote are still there: a rank
    of the new world can read a dead peer's gloo address before its successor overwrites it, and
    hang connecting to it until the timeout. The prefix names the attempt (restart count) and its
    world, which differ between any two attempts. None on a first attempt or outside torchrun."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"megahet/attempt_{attempt}_world_{os.environ['WORLD_SIZE']}/", store)


def slowest_over_ranks(*seconds: float) -> list[float]:
    """Each of this rank's times at the slowest rank's (one MAX all-reduce): every rank then decides on the same
    numbers. Every rank calls it."""
    t = torch.tensor(seconds, dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def start_distributed(tp: int, pp: int, timeout_minutes: int = 10, cp: int = 1) -> None:
    """Start torch.distributed (if needed: every rank meets the others) after checking that TP x PP x CP divides
    the world, before any rank waits on a collective."""
    apply_cpu_shims()
    check_world_size(int(os.environ.get("WORLD_SIZE", "1")), tp, pp, cp)
    _init_process_group(timeout_minutes)


def initialize_parallel(
    tp: int, pp: int, seed: int, timeout_minutes: int = 10, cp: int = 1
) -> ParallelLayout:
    """Start torch.distributed (if needed), build megatron-core's groups, and seed every stream."""
    start_distributed(tp, pp, timeout_minutes, cp)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
        )
    random.seed(seed)  # as Megatron-LM's _set_random_seed: every stream a checkpoint saves is seeded
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return current_layout()


def regroup(tp: int, pp: int, seed: int, cp: int = 1, strided: bool = False) -> ParallelLayout:
    """megatron-core's groups for another TP x PP (x CP) over the same world, in place (an escalation's move,
    megahet/runtime/relayout.py), `strided`: TP groups strided over the ranks (megatron-core's `order`
    STRIDED_ORDER). The world's group stays, the tensor-parallel RNG streams are seeded for the new TP rank.
    Every rank calls it."""
    check_world_size(dist.get_world_size(), tp, pp, cp)
    if strided and cp > 1:
        raise ValueError("strided TP groups are an escalation's placement, at CP 1")
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        **({"order": STRIDED_ORDER} if strided else {}),
    )  # fmt: skip
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return current_layout()


def current_layout() -> ParallelLayout:
    return ParallelLayout(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
        strided=_tp_groups_strided(),
    )


def _tp_groups_strided() -> bool:
    """Whether megatron-core's TP groups are strided over the ranks (`regroup(strided=True)`): read from
    this rank's TP group, so the layout says where the rank really sits."""
    if ps.get_tensor_model_parallel_world_size() == 1 or ps.get_data_parallel_world_size() == 1:
        return False
    ranks = dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())
    return ranks[1] - ranks[0] != 1


def destroy_parallel() -> None:
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


class MegatronMpu:
    """DeepSpeed's `mpu` protocol over megatron-core's parallel_state.

    DeepSpeed asks for "model parallel" ranks and groups (the ranks that hold *different* shards
    of one replica) to keep ZeRO from mixing them and to compute gradient norms once. In 3D
    parallelism that is the TP x PP group. Passing no mpu is silently wrong: DeepSpeed would
    treat every rank as a data-parallel replica and broadcast rank 0's TP shard over the others.
    It exposes no `get_sequence_parallel_*`: DeepSpeed reads those as its (Ulysses) sequence parallelism,
    which is not Megatron's TP sequence parallelism; context parallelism hands them over
    (`ContextParallelMpu`), for which DeepSpeed's gradient handling is the right one.
    """

    get_model_parallel_group = staticmethod(ps.get_model_parallel_group)
    get_tensor_model_parallel_group = staticmethod(ps.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(ps.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(ps.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_src_rank = staticmethod(ps.get_tensor_model_parallel_src_rank)
    get_pipeline_model_parallel_group = staticmethod(ps.get_pipeline_model_parallel_group)
    get_pipeline_model_parallel_rank = staticmethod(ps.get_pipeline_model_parallel_rank)
    get_pipeline_model_parallel_world_size = staticmethod(ps.get_pipeline_model_parallel_world_size)
    get_pipe_parallel_group = staticmethod(ps.get_pipeline_model_parallel_group)
    get_pipe_parallel_world_size = staticmethod(ps.get_pipeline_model_parallel_world_size)
    get_data_parallel_group = staticmethod(ps.get_data_parallel_group)
    get_data_parallel_rank = staticmethod(ps.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(ps.get_data_parallel_world_size)

    @staticmethod
    def get_model_parallel_rank() -> int:
        return dist.get_rank(group=ps.get_model_parallel_group())

    @staticmethod
    def get_model_parallel_world_size() -> int:
        return dist.get_world_size(group=ps.get_model_parallel_group())

    @staticmethod
    def get_data_parallel_group_ranks() -> list[int]:
        return dist.get_process_group_ranks(ps.get_data_parallel_group())


class ContextParallelMpu(MegatronMpu):
    """The mpu with context parallelism (parallel.cp > 1): the CP ranks are DeepSpeed's sequence-parallel
    ranks. DeepSpeed then partitions ZeRO's state over DP x CP, reduces gradients over DP x CP and divides
    them by DP alone (`seq_dp_world_size / sequence_parallel_size`): the CP ranks' gradients, each of its own
    tokens' share of the loss, are summed and the replicas' averaged, as megatron-core's DDP over
    `with_context_parallel` groups does. Its batch size counts DP only (the CP ranks share the samples)."""

    get_sequence_parallel_group = staticmethod(ps.get_context_parallel_group)
    get_sequence_parallel_rank = staticmethod(ps.get_context_parallel_rank)
    get_sequence_parallel_world_size = staticmethod(ps.get_context_parallel_world_size)

    @staticmethod
    def get_sequence_data_parallel_group():
        return ps.get_data_parallel_group(with_context_parallel=True)

    @staticmethod
    def get_sequence_data_parallel_rank() -> int:
        return ps.get_data_parallel_rank(with_context_parallel=True)

    @staticmethod
    def get_sequence_data_parallel_world_size() -> int:
        return ps.get_data_parallel_world_size(with_context_parallel=True)
