"""The benchmarks' shared launcher (benchmarks/common.py `torchrun`): a real one-rank launch whose output
streams into its log, and a failed one that raises with the log's tail.

    python -m pytest -q tests/unit/test_bench_common.py
"""

from __future__ import annotations

import pytest

from benchmarks import common


def test_a_launch_streams_its_output_into_the_log(tmp_path, monkeypatch):
    script = tmp_path / "hello.py"
    script.write_text("import os; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n")
    monkeypatch.setattr(common, "ROOT", tmp_path)
    log = tmp_path / "logs" / "hello.log"
    wall = common.torchrun("hello.py", 1, [], log)
    first, *rest = log.read_text().splitlines()
    assert "torch.distributed.run" in first and first.endswith("hello.py")  # the command line first
    assert "rank 0 of 1" in rest and wall > 0


def test_a_failed_launch_raises_with_the_logs_tail(tmp_path, monkeypatch):
    (tmp_path / "fails.py").write_text("raise SystemExit('no data wheel: run tools/fetch_data.py')\n")
    monkeypatch.setattr(common, "ROOT", tmp_path)
    with pytest.raises(RuntimeError, match=r"(?s)fails.py with 1 ranks exited with 1 .*no data wheel"):
        common.torchrun("fails.py", 1, [], tmp_path / "fails.log")
    assert "no data wheel" in (tmp_path / "fails.log").read_text()  # the log is kept
