"""megahet.checkpointing.optimizer_state on one process: `read_zero_state` merging a hand-made DeepSpeed
ZeRO-1/2 checkpoint (two DP shards, a parameter spanning both, two param groups) into full tensors with
Adam's step and the LRs, the one-line errors for a missing shard, no shards or shards of two saves (the
parallel elastic read's `saved_scalars` refuses those alike), and `zero_files`' numeric DP order (bf16
prefixes too).

Run: ``python -m pytest tests/unit/test_zero_state.py -q`` (a few seconds, mostly imports).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from deepspeed.utils.tensor_fragment import fragment_address
from one_line import one_line

from megahet.checkpointing.optimizer_state import read_zero_state, zero_files
from megahet.checkpointing.sharded_state import saved_scalars
from megahet.compat.deepspeed_checkpoint import model_states_file
from megahet.config import ConfigError

# --- read_zero_state on a hand-made DeepSpeed ZeRO-1/2 checkpoint ---------------------------------

# Two param groups over DP 2 (as DeepSpeed's stage_1_and_2 lays them out: each group's flat buffer,
# padded to a multiple of DP, split into equal partitions; a parameter may span two partitions).
# Group 0: a.weight (2, 3) + a.bias (3,) = 9 values -> partitions of 5 (1 padding value on rank 1):
#   rank 0: a.weight[0:5]            rank 1: a.weight[5:6], a.bias[0:3], padding
# Group 1: b.weight (4,) -> partitions of 2: rank 0 b.weight[0:2], rank 1 b.weight[2:4].
SHAPES = [
    OrderedDict([("a.weight", torch.Size([2, 3])), ("a.bias", torch.Size([3]))]),
    OrderedDict([("b.weight", torch.Size([4]))]),
]
MAPPINGS = [  # [dp_rank][group]: name -> (numel, start) in that partition
    [
        OrderedDict([("a.weight", fragment_address(numel=5, start=0))]),
        OrderedDict([("b.weight", fragment_address(numel=2, start=0))]),
    ],
    [
        OrderedDict([("a.weight", fragment_address(numel=1, start=0)), ("a.bias", fragment_address(3, 1))]),
        OrderedDict([("b.weight", fragment_address(numel=2, start=0))]),
    ],
]
PARTITION, LRS, STEP = [5, 2], [1e-3, 2e-3], 7


def _originals() -> dict[str, dict[str, torch.Tensor]]:
    """Distinct full tensors per key so that a mix-up of keys, names or order shows."""
    out, base = {}, {"fp32": 0.0, "exp_avg": 100.0, "exp_avg_sq": 200.0}
    for key, offset in base.items():
        out[key] = {}
        counter = offset
        for group in SHAPES:
            for name, shape in group.items():
                out[key][name] = torch.arange(counter, counter + shape.numel()).view(shape).float()
                counter += shape.numel()
    return out


def _flat_partition(tensors: dict[str, torch.Tensor], group: int, dp_rank: int, pad: bool) -> torch.Tensor:
    flat = torch.cat([tensors[name].flatten() for name in SHAPES[group]])
    size = PARTITION[group]
    flat = torch.cat([flat, torch.full((size * 2 - flat.numel(),), -1.0)])  # padding values: -1
    part = flat[dp_rank * size : (dp_rank + 1) * size].clone()
    if not pad and dp_rank == 1:  # single_partition_of_fp32_groups is saved without the group's padding
        part = part[: sum(shape.numel() for shape in SHAPES[group].values()) - size]
    return part


def _write_zero_checkpoint(folder: Path, dp_ranks=(0, 1), mp_rank: int = 0) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    originals = _originals()
    torch.save({"module": {}, "param_shapes": SHAPES}, folder / model_states_file(mp_rank))
    for dp in dp_ranks:
        state = {
            g: {
                "step": torch.tensor(float(STEP)),
                "exp_avg": _flat_partition(originals["exp_avg"], g, dp, pad=True),
                "exp_avg_sq": _flat_partition(originals["exp_avg_sq"], g, dp, pad=True),
            }
            for g in range(len(SHAPES))
        }
        optimizer_state_dict = {
            "single_partition_of_fp32_groups": [
                _flat_partition(originals["fp32"], g, dp, pad=False) for g in range(len(SHAPES))
            ],
            "base_optimizer_state": {
                "state": state,
                "param_groups": [{"lr": lr, "params": [g]} for g, lr in enumerate(LRS)],
            },
            "param_slice_mappings": MAPPINGS[dp],
            "partition_count": [2, 2],
        }
        name = f"zero_pp_rank_{dp}_mp_rank_{mp_rank:02d}_optim_states.pt"
        torch.save({"optimizer_state_dict": optimizer_state_dict, "ds_version": "0.19"}, folder / name)
    return originals


def test_hand_made_checkpoint_layout_is_consistent(tmp_path: Path) -> None:
    """The fixture itself: fp32 partitions without padding, a.weight spanning both DP ranks."""
    _write_zero_checkpoint(tmp_path)
    rank1 = torch.load(tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt", weights_only=False)
    fp32 = rank1["optimizer_state_dict"]["single_partition_of_fp32_groups"]
    assert [t.numel() for t in fp32] == [4, 2]
    assert not (fp32[0] == -1).any()
    spanning = [name for name in MAPPINGS[0][0] if name in MAPPINGS[1][0]]
    assert spanning == ["a.weight"]


def test_read_zero_state_merges_dp_shards(tmp_path: Path) -> None:
    originals = _write_zero_checkpoint(tmp_path / "iter_0000007")
    state = read_zero_state(tmp_path / "iter_0000007", mp_rank=0)
    assert state["step"] == STEP and isinstance(state["step"], int)
    assert state["lr"] == LRS
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        assert set(state[key]) == {"a.weight", "a.bias", "b.weight"}
        for name, expected in originals[key].items():
            got = state[key][name]
            assert got.shape == expected.shape and got.dtype == torch.float32
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_read_zero_state_elastic_list_format(tmp_path: Path) -> None:
    """DeepSpeed's elastic checkpoints keep base_optimizer_state as a list of per-group states (no LRs)."""
    folder = tmp_path / "iter_0000007"
    originals = _write_zero_checkpoint(folder)
    for dp in (0, 1):
        file = folder / f"zero_pp_rank_{dp}_mp_rank_00_optim_states.pt"
        saved = torch.load(file, weights_only=False)
        base = saved["optimizer_state_dict"]["base_optimizer_state"]
        saved["optimizer_state_dict"]["base_optimizer_state"] = [base["state"][g] for g in range(len(SHAPES))]
        torch.save(saved, file)
    state = read_zero_state(folder, mp_rank=0)
    assert state["step"] == STEP and state["lr"] is None
    torch.testing.assert_close(state["exp_avg"]["a.weight"], originals["exp_avg"]["a.weight"], rtol=0, atol=0)


def test_shards_of_two_saves_are_refused_by_both_reshard_paths(tmp_path: Path) -> None:
    """DP rank 1's file from a later save (Adam step 8, not 7): rank 0's merge (`read_zero_state`) and the
    parallel elastic read (`saved_scalars`, which every rank's restored step comes from) refuse it with
    the same one-line error, rather than mixing two saves' optimizer states."""
    folder = tmp_path / "iter_0000007"
    _write_zero_checkpoint(folder)
    file = folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    saved = torch.load(file, weights_only=False)
    saved["optimizer_state_dict"]["base_optimizer_state"]["state"][1]["step"] = torch.tensor(float(STEP + 1))
    torch.save(saved, file)
    meta = {"layout": {"tp": 1, "pp": 1, "dp": 2}, "model": {"num_layers": 2}}
    messages = []
    for read in (lambda: read_zero_state(folder, mp_rank=0), lambda: saved_scalars(folder, meta)):
        with pytest.raises(ConfigError) as excinfo:
            read()
        messages.append(one_line(excinfo))
    assert messages[0] == messages[1], messages
    assert (
        messages[0].startswith(f"train.load: {folder}:")
        and f"different Adam steps [{STEP}, {STEP + 1}]" in messages[0]
    )


def test_read_zero_state_missing_shard_is_incomplete(tmp_path: Path) -> None:
    """Only DP rank 0's file: a.weight (spanning both partitions) has 5 of its 6 values."""
    _write_zero_checkpoint(tmp_path, dp_ranks=(0,))
    with pytest.raises(ConfigError) as excinfo:
        read_zero_state(tmp_path, mp_rank=0)
    message = one_line(excinfo)
    assert message.startswith("train.load:")
    assert "incomplete" in message and "mp_rank_00" in message


def test_read_zero_state_without_shards_names_the_mp_rank(tmp_path: Path) -> None:
    torch.save({"module": {}, "param_shapes": SHAPES}, tmp_path / model_states_file(0))
    with pytest.raises(ConfigError) as excinfo:
        read_zero_state(tmp_path, mp_rank=0)
    message = one_line(excinfo)
    assert message.startswith("train.load:") and "mp_rank_00" in message


def test_read_zero_state_reads_only_its_mp_rank(tmp_path: Path) -> None:
    """Shards of mp_rank_01 are not mp_rank_00's: with only those, mp_rank_00 has none."""
    _write_zero_checkpoint(tmp_path, mp_rank=1)
    torch.save({"module": {}, "param_shapes": SHAPES}, tmp_path / model_states_file(0))
    with pytest.raises(ConfigError, match="mp_rank_00"):
        read_zero_state(tmp_path, mp_rank=0)
    assert read_zero_state(tmp_path, mp_rank=1)["step"] == STEP


def test_zero_files_in_numeric_dp_order(tmp_path: Path) -> None:
    for dp in reversed(range(12)):
        (tmp_path / f"zero_pp_rank_{dp}_mp_rank_03_optim_states.pt").touch()
        (tmp_path / f"zero_pp_rank_{dp}_mp_rank_13_optim_states.pt").touch()  # another mp rank
    names = [p.name for p in zero_files(tmp_path, 3)]
    assert names == [f"zero_pp_rank_{dp}_mp_rank_03_optim_states.pt" for dp in range(12)]


def test_zero_files_bf16_prefix(tmp_path: Path) -> None:
    """BF16_Optimizer names its shards bf16_zero_pp_rank_D_mp_rank_MM_optim_states.pt."""
    for dp in (2, 10, 1, 0):
        (tmp_path / f"bf16_zero_pp_rank_{dp}_mp_rank_00_optim_states.pt").touch()
    with pytest.raises(ConfigError, match="not one set of DP ranks 0..N-1"):  # ranks 3-9 missing
        zero_files(tmp_path, 0)
    for dp in range(3, 10):
        (tmp_path / f"bf16_zero_pp_rank_{dp}_mp_rank_00_optim_states.pt").touch()
    assert [p.name.split("_")[4] for p in zero_files(tmp_path, 0)] == [str(dp) for dp in range(11)]
    (tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt").touch()  # mixed kinds
    with pytest.raises(ConfigError, match="incomplete or mixed"):
        zero_files(tmp_path, 0)
