"""The check every bad-input test makes: the error's message is one line and names what it must.

with pytest.raises(ConfigError) as err:
    validate(cfg)
one_line(err, "train.global_batch_size", "micro_batch_size")
"""

from __future__ import annotations

import pytest


def one_line(err: pytest.ExceptionInfo[BaseException], *needles: str) -> str:
    """The raised error's message, asserted to be one line containing every needle."""
    msg = str(err.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg
