"""The training loop does not read the loss back to the host every step (one process, gloo, pretrain_vit).

On a GPU, `float(loss)` waits for the step's kernels: a read per step keeps the host from queueing the
next step's work. `Trainer.train_step(sync=False)` leaves the loss a tensor; `train()` converts a
window's records only when it logs them, and its history holds floats.

Run: ``python -m pytest tests/unit/test_train_loop.py -q``
"""

from __future__ import annotations

import torch
from test_resize_executor import _pretrain_vit

from megahet import trainer as trainer_module
from megahet import training
from megahet.config import load_config


def test_the_loop_reads_the_loss_only_when_it_logs(world1, tmp_path, monkeypatch) -> None:
    vit = _pretrain_vit()
    argv = [
        "--model.num_layers", "1", "--model.hidden_size", "32", "--model.num_attention_heads", "4",
        "--model.patch_size", "7", "--train.micro_batch_size", "4", "--train.global_batch_size", "8",
        "--train.train_iters", "4", "--train.log_interval", "2", "--train.eval_interval", "100",
        "--train.eval_iters", "1", "--logging.wandb", "false", "--logging.log_dir", str(tmp_path / "runs"),
    ]  # fmt: skip
    trainer = training.setup(load_config(argv, defaults=vit.default_config()), vit.SPEC)
    record = trainer.train_step(sync=False)
    assert torch.is_tensor(record["loss"]) and record["loss"].dim() == 0
    converted = []
    real = trainer_module.as_floats
    monkeypatch.setattr(trainer_module, "as_floats", lambda r: converted.append(trainer.iteration) or real(r))
    history = trainer.train()  # steps 2, 3, 4: log lines after steps 2 and 4
    assert converted == [2, 4, 4]
    assert all(isinstance(r["loss"], float) and isinstance(r["grad_norm"], float) for r in history)
    assert isinstance(trainer.train_step()["loss"], float)
