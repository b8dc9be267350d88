"""Kill and resume with measured data-parallel shares and a measured pipeline split: exact, RNG too.

Two 4-rank runs of workers/ckpt_train.py (through `train_to_end`, which re-splits the stages as
pretrain() does), each uninterrupted and killed-and-resumed, like test_resume_balance.py:
- `dp`: DP=4 with `hetero.dp_shares measured`; a virtual device makes replica 3 four times slower from
  step SLOW_FROM on, after the step-4 checkpoint: its share falls during the resumed part;
- `pp`: PP=2 x DP=2, 8 layers, `hetero.pp_split measured`; stage 1 (ranks 2 and 3) becomes four times
  slower from SLOW_FROM: the stages are re-split (the layers move rank to rank) after step 4;
- `pp_move`: the same run, killed in the middle of its first re-split's state move (nothing of the move
  is on disk): it resumes from its step-4 checkpoint and re-splits again. Its uninterrupted run is
  `full_pp` (the same job).
`ck_<job>` starts from a copy of full_<job>'s step-4 checkpoint (the balancer's samples, the shares or
split, RNG), one of its ranks SIGKILLs itself in the middle of step KILL_STEP, torchrun restarts every
rank and the run resumes from its own latest checkpoint. Its per-step loss, gradient norm and LR, its
final validation loss, the plan it ran (shares or layers per stage, step by step) and its final
checkpoint's saved RNG states (Python, NumPy, torch, the model-parallel tracker) must equal the
uninterrupted run's. The plans move by margins far beyond measurement noise (a 4x slow replica or
stage; hysteresis 0.2), so the plan a run executes depends on its restored state, not on timing.

Run: ``python -m pytest tests/distributed/test_resume_measured.py -q`` (about 2 minutes on 2 cores)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import (
    GPT_MODEL,
    compare_resumed,
    full_and_killed_runs,
    read_records,
    short_run,
)

STEPS, KILL_STEP, SLOW_FROM = 12, 10, 5  # full_and_killed_runs kills in step 10
SEED = 1234  # train.seed's default
COMMON = [
    *GPT_MODEL,
    *short_run(STEPS),
    "--train.micro_batch_size", "1",
    "--train.global_batch_size", "16",
    "--train.save_interval", "4",
    "--resize.enabled", "true",
    "--device.rate_gflops", "1",
    "--hetero.hysteresis", "0.2",
]  # fmt: skip
JOBS = {
    "dp": f"--parallel.zero_stage 1 --hetero.dp_shares measured "
    f"--device.profile schedule:0=1,1,1,1;{SLOW_FROM}=1,1,1,0.25",
    "pp": f"--parallel.pp 2 --model.num_layers 8 --hetero.pp_split measured --hetero.window 1 "
    f"--hetero.pp_patience 2 --hetero.healthy_gap 0.2 --device.profile schedule:0=1,1,1,1;{SLOW_FROM}=1,1,0.25,0.25",
}
JOBS["pp_move"] = JOBS["pp"]  # killed in the middle of its first re-split's state move
FULL = {"dp": "dp", "pp": "pp", "pp_move": "pp"}  # the uninterrupted run each killed one must equal
KILL_AT = {"dp": str(KILL_STEP), "pp": str(KILL_STEP), "pp_move": "move"}
PLAN_KEYS = {
    "dp": ("share_dp0", "share_dp1", "share_dp2", "share_dp3"),
    "pp": ("layers_pp0", "layers_pp1"),
    "pp_move": ("layers_pp0", "layers_pp1"),
}


def _job(name: str, job: str, out: Path, load: bool = False) -> list[str]:
    extra = f"{JOBS[job]} --logging.metrics_file {out / (name + '.jsonl')} --train.save {out / name}"
    extra += f" --logging.log_dir {out / 'logs' / name}"
    return ["--job", f"{name}={extra}" + (f" --train.load {out / name}" if load else "")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, gpt_data: list[str]) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("resume_measured")
    common = ["--", *COMMON, *gpt_data]

    def job(name: str, variant: str, load: bool) -> list[str]:
        return _job(name, variant, out, load=load)

    output = full_and_killed_runs(
        out, JOBS, job, common, killed_rank=lambda k: k + 1, kill_at=KILL_AT.get, reference=FULL.get
    )
    return out, output


def test_every_fault_was_a_real_kill_and_restart(runs) -> None:
    """Each killed run logged a step twice: step KILL_STEP - 1 once before the kill and once after
    resuming from its step-8 checkpoint in the restarted processes; `pp_move` the step after which its
    stages re-split (killed in the move), once before and once after resuming from its step-4 one."""
    out, output = runs
    assert output.count("-9") >= len(JOBS), output[-4000:]  # torchrun saw each rank die of SIGKILL
    for job in JOBS:
        lines = (out / f"ck_{job}.jsonl").read_text().splitlines()
        twice = KILL_STEP - 1
        if job == "pp_move":
            twice = min(
                s for s, r in read_records(out / f"full_{FULL[job]}.jsonl").items() if "resplit_s" in r
            )
        again = [line for line in lines if f'"step": {twice},' in line and '"loss"' in line]
        assert len(again) == 2, f"{job}: step {twice} not run twice"


@pytest.mark.parametrize("job", JOBS)
def test_kill_and_resume_is_exact(runs, job: str) -> None:
    out, _ = runs
    full, resumed = read_records(out / f"full_{FULL[job]}.jsonl"), read_records(out / f"ck_{job}.jsonl")
    steps = range(5, STEPS + 1)
    assert all(s in resumed and "loss" in resumed[s] for s in steps), sorted(resumed)
    plan = [tuple(resumed[s][k] for k in PLAN_KEYS[job]) for s in steps]
    assert plan == [tuple(full[s][k] for k in PLAN_KEYS[job]) for s in steps], f"{job}: the plan differs"
    even = plan[0]
    assert len(set(even)) == 1 and plan[-1] != even, f"{job}: the plan never moved off even: {plan}"
    compare_resumed(f"kill_resume_{job}", full, resumed, range(5, STEPS + 1))


def test_stages_whose_state_is_loaded_skip_initializing_their_weights(runs) -> None:
    """A resumed run and a re-split build their stages without initializing the weights (`perform_initialization=False`; the
    state loaded next overwrites all of them); a fresh run that never
    re-split initializes them. Exactness with it is test_kill_and_resume_is_exact."""
    out, _ = runs
    for rank in range(4):
        built = {name: torch.load(out / f"{name}_rank{rank}.pt")["initialized"] for name in _names()}
        assert built == {name: name == "full_dp" for name in _names()}, f"rank {rank}: {built}"


def _names() -> list[str]:
    return [f"full_{job}" for job in dict.fromkeys(FULL.values())] + [f"ck_{job}" for job in JOBS]


@pytest.mark.parametrize("job", JOBS)
def test_final_checkpoint_saves_the_uninterrupted_rng_states(runs, job: str) -> None:
    """Every stream a checkpoint saves is seeded at start and restored on resume, so the final
    checkpoint of the killed-and-resumed run holds the uninterrupted run's RNG states on every rank."""
    from megahet.checkpointing.safe_load import load_file

    out, _ = runs
    tag = f"iter_{STEPS:07d}"
    for rank in range(4):
        name = f"megahet_rank_{rank:05d}.pt"
        full = load_file(out / f"full_{FULL[job]}" / tag / name)["rng"]
        resumed = load_file(out / f"ck_{job}" / tag / name)["rng"]
        assert full["python"] == resumed["python"], f"{job} rank {rank}: Python RNG differs"
        assert full["numpy"] == resumed["numpy"], f"{job} rank {rank}: NumPy RNG differs"
        assert torch.equal(full["torch"], resumed["torch"]), f"{job} rank {rank}: torch RNG differs"
        for stream, state in full["tracker"].items():
            assert torch.equal(state, resumed["tracker"][stream]), f"{job} rank {rank}: {stream} differs"


def test_saved_python_and_numpy_states_are_the_seeded_ones(runs) -> None:
    """The global Python and NumPy generators are seeded from train.seed (nothing in megahet draws from
    them), so any launch saves the same states: a run resumed in new processes cannot differ from the
    uninterrupted one there. Unseeded, each process would save its own random state."""
    import random

    import numpy as np

    from megahet.checkpointing.safe_load import load_file

    random.seed(SEED)
    np.random.seed(SEED)
    python, (name, key, *rest) = random.getstate(), np.random.get_state()
    out, _ = runs
    for job in dict.fromkeys(FULL.values()):
        saved = load_file(out / f"full_{job}" / "iter_0000004" / "megahet_rank_00000.pt")["rng"]
        assert saved["python"] == python, f"{job}: the Python RNG state is not the seeded one"
        assert saved["numpy"] == (name, key.tolist(), *rest), (
            f"{job}: the NumPy RNG state is not the seeded one"
        )
