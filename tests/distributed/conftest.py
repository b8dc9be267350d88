"""Fixtures of the distributed tests: a small real GPT dataset, built once per session."""

from __future__ import annotations

import pytest
from harness import REPORT

CORPUS_DOCUMENTS = 400  # of the shuffled 1227 plays + chapters: enough for every split, quick to tokenize
VOCAB_SIZE = 1024  # TP=1 and TP=2 pad it to the same 1024 rows


@pytest.fixture(scope="session")
def gpt_data(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Config overrides pointing pretrain_gpt at a fresh dataset (corpus slice, tokenizer, .bin/.idx)."""
    from megahet.data.corpus import write_corpus_jsonl
    from megahet.data.prepare import ensure_gpt_data, gpt_data_paths

    root = tmp_path_factory.mktemp("gpt_data")
    corpus, _, _ = gpt_data_paths(root, VOCAB_SIZE)
    write_corpus_jsonl(corpus)
    lines = corpus.read_text(encoding="utf-8").splitlines(keepends=True)
    corpus.write_text("".join(lines[:CORPUS_DOCUMENTS]), encoding="utf-8")
    prefix, model = ensure_gpt_data(root, vocab_size=VOCAB_SIZE)  # keeps the sliced corpus
    return ["--data.data_path", prefix, "--data.tokenizer_model", model]


def pytest_terminal_summary(terminalreporter) -> None:
    if not REPORT:
        return
    write = terminalreporter.write_line
    terminalreporter.section("distributed equivalence: observed differences")
    write(f"{'test':<34} {'compared':<44} {'max|a-b|':>9} {'/max|b|':>9} {'tol used':>8}  worst")
    for test, what, max_abs, max_rel, used, worst in REPORT:
        write(f"{test:<34} {what:<44} {max_abs:9.2e} {max_rel:9.2e} {used:8.3f}  {worst}")
