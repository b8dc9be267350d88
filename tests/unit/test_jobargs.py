"""The multi-job test workers' command line (tests/distributed/workers/jobargs.py): fields, overrides
that contain ':' and '=', the common overrides after `--`, and a malformed job.

    python -m pytest -q tests/unit/test_jobargs.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed" / "workers"))
from jobargs import parse_jobs


def test_jobs_split_their_fields_and_keep_colons_in_their_overrides():
    argv = ["--out", "d", "--job", 'm50=gpt:plain:--resize.migrate 0:0.5 --x "a=b"', "--job", "b=vit:plain:"]
    args, jobs = parse_jobs([*argv, "--", "--train.train_iters", "4"], ["task", "mode"])
    assert args.out == Path("d")
    assert jobs == [
        ("m50", ("gpt", "plain"), ["--train.train_iters", "4", "--resize.migrate", "0:0.5", "--x", "a=b"]),
        ("b", ("vit", "plain"), ["--train.train_iters", "4"]),
    ]
    _, jobs = parse_jobs(["--out", "d", "--job", "plain=--parallel.tp 1"], [])
    assert jobs == [("plain", (), ["--parallel.tp", "1"])]


def test_a_job_missing_a_field_is_an_error(capsys):
    with pytest.raises(SystemExit):
        parse_jobs(["--out", "d", "--job", "m50=gpt"], ["task", "mode"])
    assert "--job 'm50=gpt': expected NAME=TASK:MODE:" in capsys.readouterr().err
