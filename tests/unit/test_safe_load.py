"""The safe checkpoint loader on files that are not torch checkpoints (megahet/checkpointing/safe_load.py).

The resumes that refuse a crafted torch checkpoint, and the allow-list of what megahet saves, are in
test_checkpoint.py.

    pytest tests/unit/test_safe_load.py
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from one_line import one_line
from test_checkpoint import _RunsCode

from megahet.checkpointing.safe_load import load_file
from megahet.config import ConfigError


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_a_plain_pickle_that_would_run_code_is_named_not_called_corrupt(
    tmp_path: Path, protocol: int
) -> None:
    """A plain pickle (not torch's zip format) whose unpickling would run a command: refused with one line
    that says what it is and names the callable it imports, read from its opcodes; nothing runs (issue 49,
    item 4: it was reported as truncated or corrupt)."""
    marker = tmp_path / "ran"
    path = tmp_path / "megahet_rank_00000.pt"
    path.write_bytes(pickle.dumps({"rng": _RunsCode(marker)}, protocol=protocol))
    with pytest.raises(ConfigError) as err:
        load_file(path)
    msg = one_line(err, str(path), "system", "does not load")
    assert "corrupt" not in msg and not marker.exists()
    truncated = tmp_path / "cut.pt"
    torch.save({"w": torch.ones(4)}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:40])
    with pytest.raises(ConfigError) as err:
        load_file(truncated)
    one_line(err, "truncated or corrupt")  # a cut torch file is still called so
