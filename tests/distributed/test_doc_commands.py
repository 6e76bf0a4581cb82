"""Every command README.md and docs/*.md show in a code block works as written, in a fresh clone.

The commands are read from the pages, in page order (README first), and run from a copy of the repository's
files (what a clone has: no .demo/, no outputs/), with the venv's console scripts on PATH. Which ones run
is read from the pages themselves, by this convention:

- ``(GPU)`` in the command's trailing comment, or in a comment line above it (up to the next blank line):
  needs the GPUs the recipe was sized for; not run;
- a synopsis: a command with ``[optional]`` parts or an UPPER-CASE placeholder (RECIPE.yaml, HF_DIR): not run;
- a training job or a long tool: ``roll-train`` without --help/--print-config/--dry-run/--plan/--version,
  torchrun/deepspeed starting ``roll.cli``, ``make``, ``pytest``, ``roll-bench``: not run (the recipe tests
  and the demo cover them);
- everything else runs (help, print-config, dry-run, plan, building the tiny model, conversion on it,
  roll-parity with ``--steps 2``) and must exit 0, or N where its comment says ``exit N until ...``.

The commands that only read the repository's files (``Command.reads_only_the_repo``: help, print-config, plan,
listings) run beside the others, one at a time; the others run one after the other in page order, as a reader
types them (a later one may use what an earlier one built).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from tests.helpers import REPO, clean_env

pytestmark = pytest.mark.distributed

DOCS = ["README.md", *sorted(os.path.join("docs", name) for name in os.listdir(os.path.join(REPO, "docs"))
                             if name.endswith(".md"))]
COMMANDS = ("roll-train", "roll-parity", "roll-convert", "roll-bench", "python", "make", "torchrun",
            "deepspeed", "pip", ".venv/bin/python")
INSPECT = ("--help", "--print-config", "--dry-run", "--plan", "--version")
READ_ONLY = ("--help", "--print-config", "--plan", "--version", "--list-cases", "--list")
"""Flags of a command that writes nothing and reads only the repository (not what an earlier command built)."""
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9_]*[A-Z0-9](?!\w*=)")
FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", re.S | re.M)


@dataclass
class Command:
    where: str
    text: str
    comment: str
    """The command's trailing comment and the comment lines above it in its group."""

    @property
    def skip_reason(self) -> str | None:
        words = self.text.split()
        if "(GPU)" in self.comment:
            return "GPU"
        if "[" in self.text or PLACEHOLDER.search(self.text):
            return "synopsis"
        launches_train = words[0] in ("torchrun", "deepspeed") and "roll.cli" in words
        trains = words[0] == "roll-train" and not any(flag in words for flag in INSPECT)
        if trains or launches_train or words[0] in ("make", "roll-bench", "pip") or "pytest" in words:
            return "training job or long tool"
        return None

    @property
    def expected_code(self) -> int:
        found = re.search(r"\bexit (\d+) until\b", self.comment)
        return int(found.group(1)) if found else 0

    @property
    def reads_only_the_repo(self) -> bool:
        """A listing or an inspection (no --dry-run: that builds the data) naming nothing a command builds."""
        words = self.text.split()
        return (any(flag in words for flag in READ_ONLY) and "--dry-run" not in words
                and not any(place in self.text for place in (".demo", "outputs/", "recipes/demo/")))

    @property
    def shell(self) -> str:
        """The command as run: roll-parity for 2 steps."""
        return re.sub(r"--steps \d+", "--steps 2", self.text) if self.text.startswith("roll-parity") else self.text


def doc_commands(doc: str) -> list[Command]:
    with open(os.path.join(REPO, doc), encoding="utf-8") as fh:
        text = fh.read()
    found = []
    for block in FENCE.finditer(text):
        if block.group(2) not in ("", "bash", "sh", "shell"):
            continue
        first_line = text[:block.start()].count("\n") + 2
        lines, group = block.group(3).splitlines(), []
        i = 0
        while i < len(lines):
            start, line = i, lines[i].strip()
            while line.endswith("\\") and i + 1 < len(lines):  # a continued command
                i += 1
                line = line[:-1].rstrip() + " " + lines[i].strip()
            i += 1
            if not line:
                group = []
            elif line.startswith("#"):
                group.append(line)
            elif line.split()[0] in COMMANDS:
                command, _, comment = line.partition(" # ")
                found.append(Command(f"{doc}:{first_line + start}", command.strip(), " ".join([*group, comment])))
    return found


def test_doc_command_convention_reads_the_pages():
    """The rules see what they should on today's pages (a parser that skipped everything would pass below)."""
    by_text = {c.text: c for doc in DOCS for c in doc_commands(doc)}
    assert by_text["roll-train --help"].skip_reason is None
    gpu = by_text["torchrun --nproc_per_node=8 -m roll.cli recipes/qwen_sft.yaml --use-mca"]
    assert gpu.skip_reason == "GPU"
    assert by_text["roll-train RECIPE.yaml --print-config"].skip_reason == "synopsis"
    assert by_text["roll-train recipes/qwen_sft.yaml --use-mca"].skip_reason == "GPU"
    dry_run = by_text["roll-train recipes/qwen_sft.yaml --dry-run"]
    assert (dry_run.skip_reason, dry_run.expected_code) == (None, 2)
    assert by_text["roll-train --help"].reads_only_the_repo and by_text["roll-parity --list-cases"].reads_only_the_repo
    assert not dry_run.reads_only_the_repo  # --dry-run builds the data
    assert not by_text["python scripts/make_tiny_model.py --out .demo/tiny-qwen2"].reads_only_the_repo
    assert "roll-parity recipes/demo/tiny_sft.yaml --steps 2" in by_text[
        "roll-parity recipes/demo/tiny_sft.yaml --steps 10 nproc_per_node=2 tensor_model_parallel_size=2"].shell


def _clone(dest: str) -> None:
    """The repository's files as a clone has them (tracked, plus new files git does not ignore)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, timeout=60, check=True).stdout
    for rel in filter(None, listed.split("\0")):
        if os.path.isfile(os.path.join(REPO, rel)):
            os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
            shutil.copy2(os.path.join(REPO, rel), os.path.join(dest, rel))


def test_every_doc_command_works_in_a_fresh_clone(tmp_path):
    pytest.importorskip("megatron.core")
    if shutil.which("git") is None or not os.path.isdir(os.path.join(REPO, ".git")) and not os.path.isfile(
            os.path.join(REPO, ".git")):
        pytest.skip("needs the repository's git metadata to list a clone's files")
    clone = str(tmp_path / "clone")
    _clone(clone)
    bin_dir = os.path.dirname(sys.executable)
    env = clean_env(PYTHONPATH=clone, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    commands, seen = [], set()
    for doc in DOCS:
        for command in doc_commands(doc):
            if not command.skip_reason and command.shell not in seen:
                seen.add(command.shell)
                commands.append(command)

    def failure(command: Command) -> str | None:
        proc = subprocess.run(["bash", "-c", command.shell], cwd=clone, env=env, capture_output=True, text=True,
                              timeout=400)
        # megatron-core's 7 import-time TE/Apex warnings per rank: roll says it once, in its own log line
        noisy = "UserWarning: Transformer Engine" in proc.stderr or "Apex is not installed" in proc.stderr
        if proc.returncode != command.expected_code or "Traceback" in proc.stderr or noisy:
            return (f"{command.where}: `{command.shell}` exited {proc.returncode} (expected "
                    f"{command.expected_code}):\n{(proc.stdout + proc.stderr)[-2500:]}")
        return None

    beside = [command for command in commands if command.reads_only_the_repo]
    with ThreadPoolExecutor(max_workers=1) as pool:
        read_only = pool.map(failure, beside)
        found = {command.shell: failure(command) for command in commands if command not in beside}
        found.update(zip((command.shell for command in beside), read_only))
    failures = [found[command.shell] for command in commands if found[command.shell]]
    ran = [command.shell for command in commands]
    assert not failures, "\n\n".join(failures)
    kinds = ("roll-train --help", "--print-config", "--dry-run", "--plan", "make_tiny_model.py", "roll-parity",
             "roll-convert hf2mca", "roll-convert mca2hf")
    assert all(any(kind in shell for shell in ran) for kind in kinds), ran
