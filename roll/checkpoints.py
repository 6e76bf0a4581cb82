"""Where a run's checkpoints live and which one ``resume_from_checkpoint`` means: one rule for both backends.

Checkpoints are ``OUTPUT_DIR/checkpoint-N`` (N = optimizer steps done). A backend writes one under a
temporary name and renames it into place when complete, so a directory with this exact name is a
whole checkpoint; anything else (``checkpoint-N.tmp``) is never picked.
"""

from __future__ import annotations

import os
import re
import shutil

from roll.config.coerce import coerce, is_bool_word
from roll.errors import ConfigError

PREFIX = "checkpoint-"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_dirs(output_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every complete checkpoint in ``output_dir``, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _NAME.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isdir(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def last_checkpoint(output_dir: str) -> str | None:
    dirs = checkpoint_dirs(output_dir)
    return dirs[-1][1] if dirs else None


def resolve_resume(value, output_dir: str) -> str | None:
    """``resume_from_checkpoint``: true -> the latest checkpoint in output_dir; a path -> that
    checkpoint; false / none / empty -> None (a fresh run)."""
    text = "" if value is None else str(value).strip()
    if text.lower() in ("", "none") or (is_bool_word(text) and not coerce(text, bool)):
        return None
    if is_bool_word(text):  # the recipe's boolean words: true/yes/on/1
        last = last_checkpoint(output_dir)
        if last is None:
            raise ConfigError(f"resume_from_checkpoint=true but {output_dir!r} holds no checkpoint-N "
                              "directory; train with save_steps first or give the checkpoint path.")
        return last
    if not os.path.isdir(text):
        raise ConfigError(f"resume_from_checkpoint={text!r} is not a checkpoint directory; use true "
                          "(latest in output_dir) or a path such as OUTPUT_DIR/checkpoint-3.")
    return text


def rotate(output_dir: str, keep: int | None) -> list[str]:
    """Delete the oldest checkpoints so at most ``keep`` remain (None or <= 0: keep all); returns them."""
    if not keep or keep <= 0:
        return []
    doomed = [path for _, path in checkpoint_dirs(output_dir)[:-keep]]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed
