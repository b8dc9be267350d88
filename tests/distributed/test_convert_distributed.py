"""Conversion of real checkpoints (workers/convert_train.py; two 4-rank launches, ~2 min on 2 cores).

Launch 1 trains pretrain_gpt at TP=2 x PP=2 (GPT-2- and Llama-shaped) and pretrain_vit at TP=2 x PP=2 for
3 steps each, saving at the end, and records each sharded model's logits on fixed inputs. Here (one
process):
- the Llama checkpoint (SwiGLU, grouped-query attention, untied output layer) consolidates to a TP=1
  model with the same logits, exports to LlamaForCausalLM with the same logits and greedy tokens, and reshards TP2xPP2 -> TP2xPP1, which loads with the same logits;
- `consolidate` -> a TP=1 GPT gives the same logits; `export-hf` -> GPT2LMHeadModel gives them too,
  and greedy generation equal to megahet's own greedy loop;
- `export-vit` -> `load_vit_export` -> a single-process ViT reproduces the trained ViT's logits;
- `reshard` GPT TP2xPP2 -> TP1xPP1 -> TP4xPP1 and ViT TP2xPP2 -> TP1xPP1; launch 2 loads each
  resharded checkpoint through `setup()` (--train.load; TP1 at DP=4 with ZeRO-2, TP4 at DP=1) and
  must give the original logits, then train one more step from the saved step and data position with
  a fresh optimizer (same loss and gradient norm at TP1 and TP4).

Run: ``python -m pytest tests/distributed/test_convert_distributed.py -q``
"""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch
from harness import GPT_MODEL, LLAMA_MODEL, REPO, compare, torchrun

from megahet.config import load_config
from megahet.engine import LRSchedule
from megahet.models.gpt import build_gpt

COMMON = [
    "--train.micro_batch_size", "1", "--train.global_batch_size", "4", "--train.lr_warmup_iters", "1",
    "--train.eval_interval", "100", "--train.eval_iters", "1", "--logging.wandb", "false",
]  # fmt: skip
TP2_PP2 = ["--parallel.tp", "2", "--parallel.pp", "2"]
VIT_MODEL = ["--model.num_layers", "2", "--model.hidden_size", "32", "--model.num_attention_heads", "4",
             "--model.patch_size", "7"]  # fmt: skip
VOCAB = 1024  # the gpt_data tokenizer's vocabulary (conftest.VOCAB_SIZE)


def convert(argv: list[str]) -> int:
    """tools/convert_checkpoint.py's main() in this process; its exit status."""
    if str(REPO / "tools") not in sys.path:
        sys.path.insert(0, str(REPO / "tools"))
    from convert_checkpoint import main

    return main(argv)


def _scheduled_lr(cfg, steps: int) -> float:
    """The learning rate megahet's schedule (megatron-core's OptimizerParamScheduler) sets after `steps`
    optimizer steps."""
    optimizer = torch.optim.SGD(
        [{"params": [torch.nn.Parameter(torch.zeros(1))], "wd_mult": 1.0}], lr=cfg.train.lr
    )
    schedule = LRSchedule(optimizer, cfg)
    schedule.step(steps)
    return optimizer.param_groups[0]["lr"]


def launch(out, jobs: list[dict]) -> tuple[dict[str, dict], str]:
    (out / "jobs.json").write_text(json.dumps(jobs))
    log = torchrun(
        "workers/convert_train.py", 4, ["--out", str(out), "--jobs", str(out / "jobs.json")], cwd=out
    )
    return {job["name"]: torch.load(out / f"{job['name']}.pt", weights_only=False) for job in jobs}, log


@pytest.fixture(scope="module")
def trained(gpt_data, tmp_path_factory):
    """Launch 1: GPT, Llama and ViT at TP=2 x PP=2 and GPT at TP=2 x DP=2 with ZeRO-2, 3 steps, saved into
    out/gpt_ck, out/llama_ck, out/vit_ck and out/gpt_dp2_ck."""
    out = tmp_path_factory.mktemp("convert")
    gpt = [*GPT_MODEL, *gpt_data, *COMMON, *TP2_PP2, "--train.train_iters", "3"]
    vit = [*VIT_MODEL, *COMMON, *TP2_PP2, "--train.train_iters", "3"]
    llama = [*LLAMA_MODEL, *gpt_data, *COMMON, *TP2_PP2, "--train.train_iters", "3"]
    gpt_dp2 = [*GPT_MODEL, *gpt_data, *COMMON, "--parallel.tp", "2", "--parallel.zero_stage", "2",
               "--train.train_iters", "3"]  # fmt: skip
    jobs = [
        {"name": "gpt", "task": "gpt", "argv": [*gpt, "--train.save", str(out / "gpt_ck")]},
        {"name": "vit", "task": "vit", "argv": [*vit, "--train.save", str(out / "vit_ck")]},
        {"name": "llama", "task": "gpt", "argv": [*llama, "--train.save", str(out / "llama_ck")]},
        {"name": "gpt_dp2", "task": "gpt", "argv": [*gpt_dp2, "--train.save", str(out / "gpt_dp2_ck")]},
    ]
    results, _ = launch(out, jobs)
    return out, results, {"gpt": gpt, "vit": vit, "llama": llama}


def test_llama_tp2_pp2_checkpoint_consolidates(trained, world1):
    """SwiGLU's per-rank [gate; up] fc1 rows, the grouped-query qkv and the untied output layer of the
    last stage merge into the TP=1 model: the same logits."""
    out, results, _ = trained
    tokens, expected = results["llama"]["inputs"], results["llama"]["after"]
    assert convert(["consolidate", "--load", str(out / "llama_ck"), "--out", str(out / "llama.pt")]) == 0
    state = torch.load(out / "llama.pt")
    assert "output_layer.weight" in state and not torch.equal(
        state["output_layer.weight"], state["embedding.word_embeddings.weight"]
    )
    model = build_gpt(load_config(LLAMA_MODEL), VOCAB).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    with torch.no_grad():
        logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    compare("convert llama tp2pp2", "consolidated TP1 logits", logits, expected)

    from transformers import LlamaForCausalLM

    assert convert(["export-hf", "--load", str(out / "llama_ck"), "--out", str(out / "hf_llama")]) == 0
    hf = LlamaForCausalLM.from_pretrained(out / "hf_llama").eval()
    with torch.no_grad():
        compare("convert llama tp2pp2", "HF Llama logits", hf(tokens).logits, expected)
        ours = tokens[:, :8]
        for _ in range(10):
            positions = torch.arange(ours.shape[1]).expand_as(ours)
            ours = torch.cat([ours, model(ours, positions, None)[:, -1].argmax(-1, keepdim=True)], dim=1)
    prompt = tokens[:, :8]
    theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                         pad_token_id=0)  # fmt: skip
    assert torch.equal(theirs, ours)


def test_tp2_pp2_checkpoint_consolidates_and_exports(trained, world1):
    from transformers import GPT2LMHeadModel

    out, results, _ = trained
    tokens, expected = results["gpt"]["inputs"], results["gpt"]["after"]
    assert convert(["consolidate", "--load", str(out / "gpt_ck"), "--out", str(out / "model.pt")]) == 0
    model = build_gpt(load_config(GPT_MODEL), VOCAB).eval()
    missing, unexpected = model.load_state_dict(torch.load(out / "model.pt"), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        logits = model(tokens, positions, None)
    compare("convert tp2pp2", "consolidated TP1 logits", logits, expected)

    # the checkpoint records its model settings: export-hf needs no --model.*
    assert convert(["export-hf", "--load", str(out / "gpt_ck"), "--out", str(out / "hf")]) == 0
    hf = GPT2LMHeadModel.from_pretrained(out / "hf").eval()
    with torch.no_grad():
        hf_logits = hf(tokens).logits
    compare("convert tp2pp2", "HF GPT-2 logits", hf_logits, expected)

    prompt = tokens[:, :8]
    ours = prompt
    with torch.no_grad():
        for _ in range(10):
            step = model(ours, torch.arange(ours.shape[1]).expand_as(ours), None)[:, -1].argmax(
                -1, keepdim=True
            )
            ours = torch.cat([ours, step], dim=1)
    theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                         pad_token_id=0)  # fmt: skip
    assert torch.equal(theirs, ours)


def test_vit_export_reproduces_the_trained_logits(trained, world1):
    import dataclasses

    from megahet.checkpointing.hf_export import load_vit_export
    from megahet.config import MegahetConfig
    from megahet.models.vit import build_vit

    out, results, _ = trained
    assert convert(["export-vit", "--load", str(out / "vit_ck"), "--out", str(out / "vit")]) == 0
    model_cfg, state = load_vit_export(out / "vit")
    assert (model_cfg.num_layers, model_cfg.hidden_size, model_cfg.patch_size) == (2, 32, 7)
    model = build_vit(dataclasses.replace(MegahetConfig(), model=model_cfg)).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    with torch.no_grad():
        logits = model(results["vit"]["inputs"])  # (8, 10)
    compare("convert vit tp2pp2", "exported ViT logits", logits, results["vit"]["after"])


def test_resharded_checkpoints_load_and_continue(trained, capsys):
    out, results, argv = trained
    t0 = time.perf_counter()
    # The save records the tokenizer's vocabulary, so TP2 -> TP1 re-pads without --vocab-size.
    saved = max((out / "gpt_ck").glob("iter_*/megahet.json"))
    assert json.loads(saved.read_text())["vocab_size"] == VOCAB
    assert convert(["reshard", "--load", str(out / "gpt_ck"), "--out", str(out / "gpt_tp1"), "--tp", "1",
                    "--pp", "1"]) == 0  # fmt: skip
    seconds = time.perf_counter() - t0
    assert convert(["reshard", "--load", str(out / "gpt_tp1"), "--out", str(out / "gpt_tp4"), "--tp", "4",
                    "--pp", "1"]) == 0  # fmt: skip
    assert convert(["reshard", "--load", str(out / "vit_ck"), "--out", str(out / "vit_tp1"), "--tp", "1",
                    "--pp", "1"]) == 0  # fmt: skip
    assert convert(["reshard", "--load", str(out / "llama_ck"), "--out", str(out / "llama_tp2pp1"), "--tp", "2",
                    "--pp", "1"]) == 0  # fmt: skip
    assert "TP 2 x PP 2 -> TP 1 x PP 1, weights only" in capsys.readouterr().out
    print(f"reshard GPT TP2xPP2 -> TP1: {seconds:.2f} s")
    # saved data is never overwritten
    assert convert(["reshard", "--load", str(out / "gpt_ck"), "--out", str(out / "gpt_tp1"), "--tp", "2",
                    "--pp", "1"]) == 2  # fmt: skip

    one_more = ["--train.train_iters", "4"]
    jobs = [
        {"name": "tp1", "task": "gpt", "argv": [*argv["gpt"], *one_more, "--parallel.tp", "1", "--parallel.pp",
                                               "1", "--parallel.zero_stage", "2", "--train.load",
                                               str(out / "gpt_tp1")]},
        {"name": "tp4", "task": "gpt", "argv": [*argv["gpt"], *one_more, "--parallel.tp", "4", "--parallel.pp",
                                               "1", "--train.load", str(out / "gpt_tp4")]},
        {"name": "vit_tp1", "task": "vit", "argv": [*argv["vit"], *one_more, "--parallel.tp", "1",
                                                   "--parallel.pp", "1", "--train.load", str(out / "vit_tp1")]},
        {"name": "llama_tp2", "task": "gpt", "argv": [*argv["llama"], *one_more, "--parallel.tp", "2",
                                                     "--parallel.pp", "1", "--train.load", str(out / "llama_tp2pp1")]},
    ]  # fmt: skip
    loaded, log = launch(out, jobs)
    assert log.count("is a weights-only checkpoint") == 4 and "the LR schedule restart" in log

    for name, source in (("tp1", "gpt"), ("tp4", "gpt"), ("vit_tp1", "vit"), ("llama_tp2", "llama")):
        run = loaded[name]
        compare(f"reshard {name}", "loaded logits", run["before"], results[source]["after"])
        assert (run["start_iteration"], run["start_sample"], run["iteration"]) == (3, 12, 4), name
        (step,) = run["history"]  # one step, from the saved step on, with a fresh optimizer and schedule
        # a step records the LR set for the next one: the fresh schedule's step 1 (continued: step 4)
        cfg = run["cfg"]
        fresh, continued = (_scheduled_lr(cfg, i) for i in (1, 4))
        assert step["lr"] == pytest.approx(fresh) and fresh != pytest.approx(continued), name
        assert torch.isfinite(torch.tensor(step["loss"])), name
        assert (run["after"] - run["before"]).abs().max() > 1e-4, f"{name}: the step changed nothing"
    # the same weights and samples give the same loss and gradients at TP1 x DP4 (ZeRO-2) and TP4 x DP1
    tp1, tp4 = loaded["tp1"]["history"][0], loaded["tp4"]["history"][0]
    compare("reshard tp1 vs tp4", "step 4 loss, grad norm", torch.tensor([tp1["loss"], tp1["grad_norm"]]),
            torch.tensor([tp4["loss"], tp4["grad_norm"]]))  # fmt: skip


# (checkpoint, new TP, PP, layers per stage, DP): a one-layer re-split, TP x PP x DP changes, elastic
# 4 -> 2 ranks, the gated and untied Llama, ViT, and a ZeRO-2 checkpoint at DP 2 to DP 1 and 3
PLANNED = [
    ("gpt_ck", 2, 2, (3, 1), 1),
    ("gpt_ck", 1, 1, (4,), 4),
    ("gpt_ck", 2, 1, (4,), 1),
    ("llama_ck", 2, 1, (4,), 2),
    ("llama_ck", 1, 2, (1, 3), 2),
    ("vit_ck", 1, 1, (2,), 2),
    ("gpt_dp2_ck", 2, 2, (1, 3), 1),
    ("gpt_dp2_ck", 1, 1, (4,), 3),
]


def test_reshard_plans_give_the_rank0_reshard_bit_for_bit(trained, tmp_path):
    """Each old rank's state read from its own files (its model states and its ZeRO file: DeepSpeed's
    fragments must be where the plan puts them), moved by the plan, equals the rank-0 reshard's output
    cut to each new rank's ZeRO fragment, bit for bit; and the plan moves the minimum."""
    from megahet.checkpointing.convert import find_checkpoint, reshard_into
    from megahet.checkpointing.sharded_state import (
        checkpoint_params,
        read_per_parameter_state,
        read_rank_state,
        saved_layout,
    )
    from megahet.checkpointing.state_slices import apply_plan
    from megahet.policy.reshard_plan import KEYS, Layout, reshard_plan

    out, _, _ = trained
    for i, (name, tp, pp, split, dp) in enumerate(PLANNED):
        folder, meta = find_checkpoint(out / name)
        params = checkpoint_params(folder, meta)
        old = saved_layout(meta)
        new = Layout(tp, pp, dp, split, tied=old.tied)
        plan = reshard_plan(params, old, new)
        before = {r: read_rank_state(folder, params, old, r, plan.blocks) for r in range(old.world)}
        got = apply_plan(plan, params, before, dict.fromkeys(KEYS, torch.float32))
        ref, _, _ = reshard_into(folder, meta, tmp_path / str(i), tp, pp, optimizer=True, stage_layers=split)
        for r in range(new.world):
            want = read_per_parameter_state(ref, params, new, r, plan.blocks)
            assert got[r].keys() == want.keys()
            for k, tensor in want.items():
                assert torch.equal(got[r][k], tensor), (name, new, r, k)
        moved = plan.moved() / sum(t.numel() for s in got.values() for t in s.values())
        print(
            f"reshard plan {name} {old} -> {new}: {len(plan.transfers)} transfers, {moved:.2f} of the new state moved"
        )


def test_an_elastic_restart_reads_what_the_rank0_reshard_writes(trained, world1, tmp_path):
    """`read_resharded` (each new rank reads its own slices of the saved files, memory-mapped) gives every
    new rank of TP 1 x DP 3 and TP 2 x PP 2 (1,3) x DP 1 what `reshard_checkpoint` (rank 0 merges and
    writes the whole checkpoint per parameter) writes for it, bit for bit; where the plan cannot apply
    (another precision, a vocabulary padded otherwise at the new TP) it declines, and the rank-0 path
    is taken."""
    import types

    from megahet.checkpointing.elastic import read_resharded, reshard_checkpoint
    from megahet.checkpointing.finder import find_resume_in
    from megahet.checkpointing.sharded_state import checkpoint_params, read_per_parameter_state
    from megahet.policy.reshard_plan import Layout

    out, _, _ = trained
    resume = find_resume_in(out / "gpt_dp2_ck")
    params = checkpoint_params(resume.path, resume.meta)
    for i, (tp, pp, split, dp) in enumerate([(1, 1, (4,), 3), (2, 2, (1, 3), 1)]):
        cfg = load_config(["--parallel.tp", str(tp), "--parallel.pp", str(pp)])
        written = reshard_checkpoint(cfg, resume, 0, split, tmp_path / str(i))
        new = Layout(tp, pp, dp, split)
        for rank in range(new.world):
            layout = types.SimpleNamespace(tp_size=tp, pp_size=pp, dp_size=dp, rank=rank)
            resumed = read_resharded(cfg, resume, layout, split)
            want = read_per_parameter_state(written.path, params, new, rank, blocks=2)
            state = resumed.read()
            assert state.keys() == want.keys()
            for k, tensor in want.items():
                assert torch.equal(state[k], tensor), (tp, pp, dp, rank, k)
            # into given tensors (an engine's views: `restore` reads there), written in place
            into = {k: torch.full_like(t, float("nan")) for k, t in want.items()}
            read = resumed.read(into)
            assert all(read[k] is into[k] and torch.equal(into[k], t) for k, t in want.items())
            with pytest.raises(ValueError, match="the destination holds"):
                resumed.read(dict(list(into.items())[1:]))
        assert resumed.source == "TP 2 x PP 1 x DP 2" and resumed.progress.iteration == 3
    layout = types.SimpleNamespace(tp_size=1, pp_size=1, dp_size=1, rank=0)
    bf16 = load_config(["--train.precision", "bf16"])
    assert read_resharded(bf16, resume, layout, (4,)) is None
    padded = load_config(["--model.make_vocab_size_divisible_by", "384"])  # 1024 rows -> 1152 at TP 1
    assert read_resharded(padded, resume, layout, (4,)) is None
