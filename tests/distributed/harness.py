"""Launching multi-process (gloo, CPU) workers from pytest, and comparing their results.

    out = torchrun("worker_train.py", 2, ["--out", str(tmp), ...], cwd=tmp)   # raises LaunchError

Workers are scripts in this folder, started with `python -m torch.distributed.run` on a free port
(retried if another job grabs it first) with OMP_NUM_THREADS=1, DS_ACCELERATOR=cpu and
WANDB_MODE=disabled; they write their results into a folder given on their command line.
Other launchers, and jobs of several launchers (one per emulated host), go through `launch()`:

    no_ssh = lambda port, node: deepspeed_cmd(hostfile, "127.0.0.1", port, "--no_ssh", f"--node_rank={node}")
    outs = launch(lambda port: [no_ssh(port, 0), no_ssh(port, 1)], "../../pretrain_gpt.py", 2, args, cwd=tmp)
`compare()` asserts fp32 closeness and records the observed differences, which the terminal summary
(conftest.py) prints.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.contention import descendants
from megahet.launch import deepspeed_cmd, free_port, launch_env, torchrun_cmd  # noqa: F401 (shared)
from megahet.logging import read_metrics_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/machine.py, also in the workers
from machine import REQUIRE_ALL, skip_or_fail  # noqa: F401 (shared with the unit tests)

HERE = Path(__file__).resolve().parent


REPO = HERE.parents[1]

# A small GPT (pretrain_gpt config overrides) for every GPT test.
GPT_MODEL = [
    "--model.num_layers",
    "4",
    "--model.hidden_size",
    "64",
    "--model.num_attention_heads",
    "4",
    "--model.seq_length",
    "32",
    "--model.hidden_dropout",
    "0",
    "--model.attention_dropout",
    "0",
]


# The same GPT, Llama-shaped: rotary positions, RMSNorm, SwiGLU, 2 key/value heads for 4 query heads,
# untied output layer, no linear biases.
LLAMA_MODEL = [
    *GPT_MODEL,
    "--model.position_embedding_type", "rope", "--model.normalization", "RMSNorm",
    "--model.activation", "swiglu", "--model.ffn_hidden_size", "160", "--model.num_query_groups", "2",
    "--model.untie_embeddings_and_output_weights", "true", "--model.add_bias_linear", "false",
]  # fmt: skip


def short_run(steps: int, *, eval_iters: int = 2, lr: str | None = None) -> list[str]:
    """pretrain overrides of a short test run: micro-batch 2 of a global batch of 8, LR warm-up over 2
    steps, a log line per step, one evaluation (at the end), no wandb."""
    args = [
        "--train.train_iters", str(steps),
        "--train.micro_batch_size", "2",
        "--train.global_batch_size", "8",
        "--train.lr_warmup_iters", "2",
        "--train.log_interval", "1",
        "--train.eval_interval", str(steps),
        "--train.eval_iters", str(eval_iters),
        "--logging.wandb", "false",
    ]  # fmt: skip
    return args + (["--train.lr", lr] if lr else [])


def late_ranks(*delays_ms: float) -> list[str]:
    """pretrain overrides: every rank a virtual device at full speed, rank r `delays_ms[r]` late to each
    collective it joins (device.collective_delay_ms: a time-sliced rank)."""
    return [
        "--device.profile", "static:" + ",".join("1" for _ in delays_ms),
        "--device.collective_delay_ms", ",".join(str(d) for d in delays_ms),
        "--device.rate_gflops", "1000",
    ]  # fmt: skip


def metrics_job(out: Path, name: str, args: list[str]) -> tuple[list[str], Path]:
    """pretrain's `args` with run `name`'s log folder and metrics file in `out`; and that file."""
    metrics = out / f"{name}.jsonl"
    return [*args, "--logging.log_dir", str(out / "runs"), "--logging.metrics_file", str(metrics)], metrics


def torchrun_curves(script: str, nproc: int, args: list[str], steps: int, *, cwd: Path, timeout: float = 300):
    """Run `script` (pretrain, with a metrics file: metrics_job) under torchrun; its metrics_curves."""
    args, metrics = metrics_job(cwd, "torchrun", args)
    torchrun(script, nproc, args, cwd=cwd, timeout=timeout)
    return metrics_curves(metrics, steps)


read_records = read_metrics_file
"""pretrain's --logging.metrics_file by step (a step logged twice, as by a resumed run: its last values)."""


def compare_steps(test: str, actual: dict[int, dict], expected: dict[int, dict], steps: range, what: str = "",
                  rtol: float = 1e-5) -> None:  # fmt: skip
    """Two runs' per-step loss, gradient norm and LR (read_records) over `steps` within fp32 reduction noise
    (`rtol`: runs that reduce in another order, as after a reshard or a move)."""
    for key in ("loss", "grad_norm", "lr"):
        a = torch.tensor([actual[s][key] for s in steps], dtype=torch.float64)
        b = torch.tensor([expected[s][key] for s in steps], dtype=torch.float64)
        compare(test, f"{key}, steps {steps.start}..{steps.stop - 1}{what}", a, b, rtol=rtol)


# Workers name parameters as the unsharded model does; with PP > 1 the last stage also holds the
# tied copy of the word embedding under its own name.
TIED_COPY, EMBEDDING = "output_layer.weight", "embedding.word_embeddings.weight"

# (test, what, max |a - b|, relative difference (compare: max over tensors of max |a - b| / max |b|;
# compare_updates: of ||a - b|| / ||b - init||), largest fraction of the tolerance used, its tensor)
REPORT: list[tuple[str, str, float, float, float, str]] = []


class LaunchError(AssertionError):
    """A distributed worker launch failed or timed out; the message carries its output."""


def _excerpt(output: str, limit: int = 6000) -> str:
    """The first traceback (the cause) and the end of the output (torchrun's summary)."""
    start = output.find("Traceback")
    head = output[start : start + limit // 2] if start >= 0 else ""
    tail = output[-limit // 2 :]
    return head + ("\n[...]\n" if head and not output.endswith(head) else "") + tail


def busy_processes(seconds: float = 2.0) -> float:
    """Other processes running or waiting to run, on average over `seconds` (/proc/loadavg's runnable
    count, this reader excluded): 0 on an idle machine, whatever ran a minute ago."""
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        with open("/proc/loadavg") as f:
            samples.append(int(f.read().split()[3].split("/")[0]) - 1)
        time.sleep(0.1)
    return statistics.mean(samples)


def wait_until_quiet(limit_s: float = 30.0, before: str = "the calm phase") -> float:
    """Before a phase whose checks assume a quiet machine: wait (up to limit_s) until no other process
    competes for the cores; say so on stdout (the test log) when it waited, or when the machine stayed
    busy (the caller then relaxes its checks, saying why). Returns the other runnable processes."""
    start = time.monotonic()
    busy = busy_processes()
    while busy >= 1.0 and time.monotonic() - start < limit_s:
        busy = busy_processes()
    waited = time.monotonic() - start
    if busy >= 1.0:
        print(
            f"machine still busy after {waited:.0f} s ({busy:.1f} other runnable processes): starting "
            f"{before} anyway"
        )
    elif waited > 2.5:
        print(f"waited {waited:.0f} s for the machine to be quiet before {before}")
    return busy


def _kill_launch(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every rank it started: torchrun starts each rank in a session of its
    own, so killing the launcher's process group would leave the ranks running (and holding our
    output pipe open)."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_launch(
    launcher: list[str], worker: str, args: list[str], *, cwd: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, list]:
    """Start `launcher HERE/worker args` (env: launch_env()); return (process, command)."""
    cmd = [*launcher, str(HERE / worker), *args]
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env or launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return proc, cmd


def start_torchrun(worker: str, nproc: int, args: list[str], *, cwd: Path) -> tuple[subprocess.Popen, list]:
    """Start HERE/worker under torchrun with nproc ranks on a free port; return (process, command)."""
    return start_launch(torchrun_cmd(nproc, free_port()), worker, args, cwd=cwd)


def finish(proc: subprocess.Popen, cmd: list, worker: str, nproc: int, timeout: float) -> str:
    """Wait for a started launch; return its output, or raise LaunchError (killing it on time-out)."""
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_launch(proc)
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # some rank escaped: give up on the rest of the output
            output = ""
        raise LaunchError(
            f"{worker} with {nproc} ranks timed out after {timeout:.0f} s:\n{_excerpt(output)}"
        ) from None
    if proc.returncode != 0:
        raise LaunchError(
            f"{worker} with {nproc} ranks exited with {proc.returncode}:\n{' '.join(cmd)}\n{_excerpt(output)}"
        )
    return output


def finish_all(
    started: list[tuple[subprocess.Popen, list]], worker: str, nproc: int, timeout: float, grace: float = 30
) -> list[str]:
    """Wait for the launchers of one job (one per host); return their outputs, or raise LaunchError.

    When one fails, the others get `grace` seconds to fail too (their ranks see the peers go) before
    they are killed; at the time-out, all are killed. The error carries every failed launch's output.
    """
    if len(started) == 1:
        return [finish(*started[0], worker, nproc, timeout)]
    outputs = [""] * len(started)

    def drain(i: int, proc: subprocess.Popen) -> None:  # read every pipe at once: none may fill up
        outputs[i] = proc.communicate()[0]

    threads = [threading.Thread(target=drain, args=(i, p), daemon=True) for i, (p, _) in enumerate(started)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p, _ in started) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p, _ in started):
            deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.2)
    killed = [i for i, (p, _) in enumerate(started) if p.poll() is None]
    peer_failed = any(p.returncode not in (None, 0) for p, _ in started)
    why = "killed: still running after a peer failed" if peer_failed else f"timed out after {timeout:.0f} s"
    for i in killed:
        _kill_launch(started[i][0])
    for thread in threads:
        thread.join(timeout=30)
    failed = [
        f"launcher {i + 1}/{len(started)} "
        + (why if i in killed else f"exited with {p.returncode}")
        + f":\n{' '.join(cmd)}\n{_excerpt(outputs[i], limit=6000 // len(started))}"
        for i, (p, cmd) in enumerate(started)
        if i in killed or p.returncode != 0
    ]
    if failed:
        raise LaunchError(f"{worker} with {nproc} ranks failed:\n" + "\n".join(failed))
    return outputs


def launch(
    launchers: Callable[[int], list[list[str]]],
    worker: str,
    nproc: int,
    args: list[str],
    *,
    cwd: Path,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> list[str]:
    """Run one job of nproc ranks: launchers(port) gives each launcher's command up to the script (one
    per host, all started at once, sharing a free port); return their outputs or raise LaunchError.
    Started again on another port when the port was taken between probe and bind."""
    for attempt in range(3):
        started = [start_launch(cmd, worker, args, cwd=cwd, env=env) for cmd in launchers(free_port())]
        try:
            return finish_all(started, worker, nproc, timeout)
        except LaunchError as err:
            if "EADDRINUSE" in str(err) and attempt < 2:
                continue
            raise
    raise AssertionError("unreachable")


def torchrun(worker: str, nproc: int, args: list[str], *, cwd: Path, timeout: float = 300) -> str:
    """Run HERE/worker under torchrun with nproc ranks; return its output or raise LaunchError."""
    return launch(lambda port: [torchrun_cmd(nproc, port)], worker, nproc, args, cwd=cwd, timeout=timeout)[0]


def metrics_curves(metrics: Path, steps: int) -> dict[str, torch.Tensor]:
    """From pretrain's --logging.metrics_file (log_interval 1, one evaluation): the per-step loss and
    gradient norm, and the validation loss, as float64 tensors."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    logged = [r["step"] for r in train]
    assert logged == list(range(1, steps + 1)), f"{metrics.name}: logged steps {logged}, not 1..{steps}"
    curves = {
        key: torch.tensor([r[key] for r in train], dtype=torch.float64) for key in ("loss", "grad_norm")
    }
    curves["val_loss"] = torch.tensor([r["val_loss"] for r in rows if "val_loss" in r], dtype=torch.float64)
    assert len(curves["val_loss"]) == 1, (
        f"{metrics.name}: {len(curves['val_loss'])} validation records, not 1"
    )
    return curves


def with_tied_copy(reference: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
    """The unsharded reference by name, plus the tied copy (= the word embedding) if `names` has it."""
    expected = dict(reference)
    if (
        TIED_COPY in names and TIED_COPY not in reference
    ):  # untied: the output layer is a parameter of its own
        expected[TIED_COPY] = reference[EMBEDDING]
    return expected


def compare(
    test: str,
    what: str,
    actual: torch.Tensor | dict[str, torch.Tensor],
    expected: torch.Tensor | dict[str, torch.Tensor],
    *,
    rtol: float = 1e-5,
    atol_scale: float = 1e-6,
    atol: float | None = None,
) -> float:
    """Assert |a - b| <= atol + rtol * |b| elementwise, for a tensor or every tensor of a dict.

    atol defaults to atol_scale * max |b| per tensor: the fp32 noise of a sum scales with the size of
    its terms, and parameters / gradients span orders of magnitude (a LayerNorm bias gradient of 1e-3
    next to an embedding gradient of 1e-1). Records the worst case in REPORT; returns its max |a - b|.
    """
    if not isinstance(expected, dict):
        actual, expected = {what: actual}, {what: expected}
    assert set(actual) == set(expected), (
        f"{what}: names differ: missing {sorted(set(expected) - set(actual))}, "
        f"extra {sorted(set(actual) - set(expected))}"
    )
    max_abs = max_rel = max_used = 0.0
    worst = ""
    for name in sorted(expected):
        a, b = actual[name].double(), expected[name].double()
        assert a.shape == b.shape, f"{what} {name}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        if b.numel() == 0:
            continue
        scale = b.abs().max().item()
        tensor_atol = atol if atol is not None else atol_scale * max(scale, 1e-12)
        diff = (a - b).abs()
        tol = tensor_atol + rtol * b.abs()
        used = torch.where(diff == 0, 0.0, diff / tol).max().item()  # exact matches pass a zero tolerance
        if not used <= 1.0:  # also catches NaN
            raise AssertionError(
                f"{test}: {what} {name}: max |a-b| {diff.max().item():.3e} exceeds atol {tensor_atol:.3e} + "
                f"rtol {rtol} * |b| (max |b| {scale:.3e}; {used:.1f}x the tolerance)"
            )
        max_abs = max(max_abs, diff.max().item())
        max_rel = max(max_rel, diff.max().item() / scale if scale else 0.0)
        if used >= max_used:
            max_used, worst = used, name
    REPORT.append((test, what, max_abs, max_rel, max_used, worst if len(expected) > 1 else ""))
    return max_abs


def compare_updates(
    test: str,
    what: str,
    actual: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    initial: dict[str, torch.Tensor],
    *,
    rel: float,
) -> float:
    """Assert ||a - b|| <= rel * ||b - initial|| per tensor: trained weights agree up to a small
    fraction of how far training moved them (Frobenius norms, so a few noise-driven elements do not
    dominate; see WEIGHT_REL in test_training.py). Records max |a - b| and the largest ratio."""
    assert set(actual) == set(expected) == set(initial), what
    max_abs = max_ratio = 0.0
    worst = ""
    for name in sorted(expected):
        a, b, start = actual[name].double(), expected[name].double(), initial[name].double()
        moved = (b - start).norm().item()
        off = (a - b).norm().item()
        ratio = off / moved if moved else (0.0 if off == 0 else float("inf"))
        if not ratio <= rel:
            raise AssertionError(
                f"{test}: {what} {name}: ||a-b|| {off:.3e} is {ratio:.2e} of the distance trained "
                f"||b-init|| {moved:.3e} (allowed {rel}); max |a-b| {(a - b).abs().max().item():.3e}"
            )
        max_abs = max(max_abs, (a - b).abs().max().item())
        if ratio >= max_ratio:
            max_ratio, worst = ratio, name
    REPORT.append((test, what, max_abs, max_ratio, max_ratio / rel, worst))
    return max_abs


def start_from_copy(source: Path, run: Path, tag: str = "iter_0000004") -> None:
    """A new checkpoint folder `run` whose latest is a copy of `source`'s checkpoint `tag` (a run that
    resumes from another run's step, then saves its own)."""
    run.mkdir()
    shutil.copytree(source / tag, run / tag)
    (run / "latest").write_text(tag)


def full_and_killed_runs(
    out: Path,
    variants,
    job: Callable[[str, str, bool], list[str]],
    common: list[str],
    killed_rank: Callable[[int], int],
    kill_at: Callable[[str], str] = lambda variant: "10",
    reference: Callable[[str], str] = lambda variant: variant,
) -> str:
    """Kill-and-resume runs of workers/ckpt_train.py on 4 ranks: one launch runs `full_<v>` for every
    variant v, uninterrupted; a second runs `ck_<v>` from a copy of full_<v>'s step-4 checkpoint under
    torchrun --max_restarts, where in attempt k rank killed_rank(k) SIGKILLs itself in the middle of step
    10 of the k-th variant (or kill_at(variant): a step, or "move", the start of its first re-split's
    state move), every rank restarts and the run resumes from its own latest checkpoint.
    `job(name, variant, load)`: that run's --job arguments. Variants that train the same run share one
    uninterrupted run: ck_<v> starts from full_<reference(v)>. Returns the second launch's output."""
    full = [arg for v in dict.fromkeys(map(reference, variants)) for arg in job(f"full_{v}", v, False)]
    torchrun("workers/ckpt_train.py", 4, ["--out", str(out), *full, *common], cwd=out, timeout=400)
    resumed, faults = [], []
    for k, v in enumerate(variants):
        start_from_copy(out / f"full_{reference(v)}", out / f"ck_{v}")
        resumed += job(f"ck_{v}", v, True)
        faults += ["--fault", f"ck_{v}:{kill_at(v)}:{killed_rank(k)}"]
    return launch(
        lambda port: [[*torchrun_cmd(4, port), f"--max_restarts={len(variants)}", "--monitor_interval=0.5"]],
        "workers/ckpt_train.py",
        4,
        ["--out", str(out), *faults, *resumed, *common],
        cwd=out,
        timeout=600,
    )[0]


def compare_resumed(test: str, full: dict, resumed: dict, steps: range) -> None:
    """A killed-and-resumed run's per-step loss, gradient norm and LR over `steps` and its final
    validation loss equal the uninterrupted run's (1e-6 relative; measured: bit for bit)."""
    for key in ("loss", "grad_norm", "lr"):
        actual = torch.tensor([resumed[s][key] for s in steps], dtype=torch.float64)
        expected = torch.tensor([full[s][key] for s in steps], dtype=torch.float64)
        compare(test, f"{key}, steps {steps.start}..{steps.stop - 1}", actual, expected, rtol=1e-6, atol=0)
    last = steps.stop - 1
    compare(
        test, "final val_loss", torch.tensor(resumed[last]["val_loss"]), torch.tensor(full[last]["val_loss"]),
        rtol=1e-6, atol=0,
    )  # fmt: skip
