"""Comments and docstrings cite documents by path ("docs/facts.md"); each cited document must
be in the repository, so that a maintainer reading the code can follow the citation (they once
cited design notes that lived outside it)."""

from __future__ import annotations

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: A document named in the code: a path ending in .md.
CITED = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)\b")


def _sources() -> list[str]:
    out = []
    for top in ("elasticd", "bench", "tests", "examples"):
        for root, _dirs, files in os.walk(os.path.join(REPO, top)):
            out += [os.path.join(root, f) for f in files if f.endswith(".py")]
    return [p for p in out if p != os.path.abspath(__file__)]  # its own examples


def cited_documents(text: str) -> set[str]:
    return set(CITED.findall(text))


def test_the_pattern_finds_citations():
    assert cited_documents("see docs/facts.md, and (FACTS.md) or README.md.") == {
        "docs/facts.md", "FACTS.md", "README.md"}


def test_every_cited_document_is_in_the_repository():
    missing = {}
    for path in _sources():
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        for doc in cited_documents(text):
            candidates = [os.path.join(REPO, doc), os.path.join(REPO, "docs", doc),
                          os.path.join(os.path.dirname(path), doc),
                          os.path.join(os.path.dirname(path), "results", doc)]  # bench output
            if not any(os.path.isfile(c) for c in candidates):
                missing.setdefault(os.path.relpath(path, REPO), []).append(doc)
    assert not missing, f"documents cited but not in the repository: {missing}"
