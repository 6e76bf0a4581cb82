"""Every link and repository path README.md and docs/*.md show resolves inside a clone of the repository.

A user's clone has no ../shared, no /work, no DESIGN.md: a reference to them is a dead end for a reader.
Checked: markdown links (relative ones must exist inside the repo), inline-code paths that start with a
top-level entry of the repo (``roll/config/parser.py``, ``recipes/demo/tiny_sft.yaml``; ``path::name`` and
``path:line`` suffixes allowed), any path that leaves the repo (``../``) or names /work, and every ``*.md``
file name mentioned anywhere.
"""

from __future__ import annotations

import glob
import os
import re

import pytest

from tests.helpers import REPO

DOCS = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]
TOP_LEVEL = {name for name in os.listdir(REPO) if not name.startswith(".")} - {"outputs", "data", "saves"}
"""Entries a path must start with to be a repository path (generated and user folders are not)."""

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
MD_NAME = re.compile(r"(?<![\w/.-])([\w-]+\.md)\b")
FENCE = re.compile(r"^ *```.*?^ *```", re.S | re.M)


def _inside(path: str, repo: str) -> bool:
    return os.path.realpath(path).startswith(os.path.realpath(repo) + os.sep)


def _code_tokens(text: str) -> list[str]:
    """Words of inline code and fenced blocks that look like paths."""
    chunks = INLINE_CODE.findall(FENCE.sub("", text)) + FENCE.findall(text)
    return [word.lstrip("('\"").rstrip(".,;:)'\"") for chunk in chunks for word in chunk.split() if "/" in word]


def dead_references(doc: str, repo: str = REPO, top_level: set[str] = TOP_LEVEL) -> list[str]:
    with open(os.path.join(repo, doc), encoding="utf-8") as fh:
        text = fh.read()
    here = os.path.dirname(os.path.join(repo, doc))
    dead = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on this page
        path = os.path.join(here, target.split("#")[0])
        if not (_inside(path, repo) and os.path.exists(path)):
            dead.append(f"link {target}")
    for word in _code_tokens(text):
        if word.startswith("../") or "/work/" in word or word.startswith("/work"):
            dead.append(f"path {word} (outside the repository)")
            continue
        path = word.split("::")[0]
        path = re.sub(r":\d+(-\d+)?$", "", path)
        if path.split("/")[0] not in top_level or re.search(r"[{}*<>$\[\]]|[A-Z]{2,}", path):
            continue  # not a repo path, or a pattern / placeholder (ds_z{0,2}.json, HF_DIR/...)
        if not os.path.exists(os.path.join(repo, path)):
            dead.append(f"path {word}")
    md_files = {os.path.basename(p) for p in glob.glob(os.path.join(repo, "**", "*.md"), recursive=True)}
    dead += [f"file name {name}" for name in sorted(set(MD_NAME.findall(text))) if name not in md_files]
    return dead


@pytest.mark.parametrize("doc", DOCS)
def test_every_reference_resolves_in_a_clone(doc):
    assert dead_references(doc) == []


def test_the_check_finds_dead_references(tmp_path):
    """The rules above catch the kinds of dead reference issue 33 found, and pass the live ones."""
    page = "see [design](docs/nowhere.md), `../shared/research/x.md`, DESIGN.md section 2, `roll/nope.py`, " \
           "`roll/config/parser.py::resolve`, [ok](docs/design.md), `recipes/deepspeed/ds_z{0,2}.json`, " \
           "`outputs/demo/loss.png`, [up](../../etc/passwd)\n"
    (tmp_path / "page.md").write_text(page, encoding="utf-8")
    os.makedirs(tmp_path / "docs")
    (tmp_path / "docs" / "design.md").write_text("", encoding="utf-8")
    os.makedirs(tmp_path / "roll" / "config")
    (tmp_path / "roll" / "config" / "parser.py").write_text("", encoding="utf-8")
    assert dead_references("page.md", str(tmp_path), {"roll", "docs", "recipes"}) == [
        "link docs/nowhere.md", "link ../../etc/passwd", "path ../shared/research/x.md (outside the repository)",
        "path roll/nope.py", "file name DESIGN.md"]
