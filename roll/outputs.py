"""Outputs that cannot mislead: where a run may write, whose files an output_dir holds, no stale weights.

- ``output_dir`` is a real path of the user's (``output_dir_value``; ``check_location``): not empty / null,
  ``~`` expanded, never ``/``, the home directory itself, a system directory, or the model's or the dataset's
  own folder.
- A run marks its output_dir as its own (``MARKER``, written by rank 0 once the data is ready). A non-empty
  output_dir is used only when it holds a run of the same recipe (same stage, model and finetuning_type) or
  nothing but roll's logs and bookkeeping (``check_contents``); anything else needs ``overwrite_output_dir``.
- ``checkpoint-N`` entries that are symbolic links are refused, never followed
  (``check_no_linked_checkpoints``).
- An export removes the weight files of another layout it would leave beside its own
  (``remove_stale_weights``), as transformers' ``save_pretrained`` does for its own names.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from datetime import datetime, timezone

from roll.errors import ConfigError

MARKER = ".roll_run.json"
"""Written by every run into output_dir: the recipe (stage, model, finetuning_type) its files are of."""

ROLL_OWN = frozenset({MARKER, ".roll.lock", "train_log.jsonl", "loss.png", "runs"})
"""Roll's bookkeeping and logs: alone they never make an output_dir "someone else's" (a run that saved
nothing left only these; an older roll wrote no marker)."""

_EMPTY_WORDS = ("", "none", "null")
_SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/sbin",
                 "/sys", "/usr")
"""Directories roll never writes in, nor anywhere below."""
_SYSTEM_DIRS = ("/", "/home", "/opt", "/root", "/run", "/srv", "/tmp", "/var", "/mnt", "/media")
"""Directories roll never writes straight into (a folder below them is fine)."""
_CHECKPOINT_LIKE = re.compile(r"^checkpoint-\d+(\.(tmp|old))?$")


def output_dir_value(value) -> str:
    """The recipe's ``output_dir`` as a path (``~`` expanded); ConfigError when it is empty or null."""
    text = "" if value is None else str(value).strip()
    if text.lower() in _EMPTY_WORDS:
        raise ConfigError("output_dir is empty or null (YAML also reads a lone ~ as null): set output_dir: "
                          "to the folder the run writes its checkpoints, logs and final model to, e.g. "
                          "output_dir: outputs/my-run (~/runs/my-run is expanded).")
    return os.path.expanduser(text)


def check_location(output_dir: str, *, model_dirs: list[str], data_paths: list[str]) -> None:
    """ConfigError when ``output_dir`` is a place no run should write into (see the module doc)."""
    real = os.path.realpath(output_dir)
    home = os.path.realpath(os.path.expanduser("~"))
    if real == home or real in _SYSTEM_DIRS or any(real == top or real.startswith(top + "/")
                                                   for top in _SYSTEM_TREES):
        what = "your home directory itself" if real == home else "a system directory"
        raise ConfigError(f"output_dir={output_dir!r} is {what} ({real}): a run writes checkpoints, logs and "
                          "a model there and may replace files. Set output_dir: to a folder of its own, "
                          "e.g. outputs/my-run.")
    for key, folder in [("model_name_or_path", p) for p in model_dirs] + [("dataset", p) for p in data_paths]:
        own = folder if os.path.isdir(folder) else os.path.dirname(os.path.abspath(folder))
        if os.path.exists(folder) and os.path.realpath(own) == real:
            raise ConfigError(f"output_dir={output_dir!r} is the folder of {key} ({folder}): the run "
                              "would write its files among (and over) the ones it reads. Set output_dir: "
                              "to a folder of its own, e.g. outputs/my-run.")


def check_no_linked_checkpoints(output_dir: str) -> None:
    """Refuse links named like checkpoints: resuming, rotating or cleaning would act on their target."""
    if not os.path.isdir(output_dir):
        return
    for name in sorted(os.listdir(output_dir)):
        path = os.path.join(output_dir, name)
        if _CHECKPOINT_LIKE.match(name) and os.path.islink(path):
            raise ConfigError(f"{path} is a symbolic link (to {os.readlink(path)}); roll never follows links "
                              "in output_dir, since resuming, rotating or cleaning checkpoints would act on "
                              "their target. Replace it with a copy of the checkpoint, or remove it.")


def run_identity(config) -> dict[str, str]:
    """What makes two runs "the same recipe" for an output_dir: the stage, the model and finetuning_type
    (another learning rate or dataset is the same recipe tuned; another model is another run)."""
    model = config.model.model_name_or_path or ""
    return {"stage": config.finetuning.stage, "finetuning_type": config.finetuning.finetuning_type,
            "model_name_or_path": os.path.realpath(model) if os.path.exists(model) else model}


def check_contents(output_dir: str, identity: dict[str, str]) -> None:
    """ConfigError when a non-empty ``output_dir`` is not a run of this recipe (see the module doc)."""
    if not os.path.isdir(output_dir):
        return
    others = sorted(set(os.listdir(output_dir)) - ROLL_OWN)
    marker = os.path.join(output_dir, MARKER)
    if os.path.isfile(marker):
        saved = _read_marker(marker).get("identity") or {}
        differ = [f"{key} {saved.get(key)!r} there, {value!r} here" for key, value in identity.items()
                  if saved.get(key) != value]
        if not differ:
            return
        raise ConfigError(f"output_dir {output_dir!r} holds a run of another recipe ({'; '.join(differ)}); "
                          "this run would mix its files with those. Choose another output_dir, or set "
                          "overwrite_output_dir: true to replace that run.")
    if others:
        shown = ", ".join(others[:6]) + (f" and {len(others) - 6} more" if len(others) > 6 else "")
        raise ConfigError(f"output_dir {output_dir!r} is not empty and no roll run wrote it ({shown}); the "
                          "run would write its checkpoints, logs and model among (and over) these files. "
                          "Choose an empty or new output_dir, or set overwrite_output_dir: true to write "
                          "there anyway.")


def write_marker(output_dir: str, identity: dict[str, str]) -> None:
    """Mark ``output_dir`` as this recipe's (rank 0, before anything else of the run is written there)."""
    from roll import __version__

    os.makedirs(output_dir, exist_ok=True)
    record = {"written_by": "roll-train", "roll_version": __version__, "identity": identity,
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    partial = os.path.join(output_dir, MARKER + ".tmp")
    with open(partial, "w", encoding="utf-8") as fh:
        json.dump(record, fh, indent=2, sort_keys=True)
    os.replace(partial, os.path.join(output_dir, MARKER))


def _read_marker(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


# ---- stale weights ------------------------------------------------------------------------------

WEIGHT_FILES = ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json",
                "adapter_model.safetensors", "adapter_model.bin", "adapter_config.json")
"""Names a Hugging Face loader picks weights from: one layout's files left beside another's make
``from_pretrained`` (or PEFT) load the old ones (model.safetensors wins over a new shard index)."""


def remove_stale_weights(out_dir: str, keep: set[str]) -> list[str]:
    """Delete the weight files in ``out_dir`` this export did not write (``keep``); returns their names."""
    doomed = sorted(name for name in os.listdir(out_dir) if name not in keep
                    and any(fnmatch.fnmatch(name, pattern) for pattern in WEIGHT_FILES)
                    and os.path.isfile(os.path.join(out_dir, name)))
    for name in doomed:
        os.remove(os.path.join(out_dir, name))
    return doomed


def weight_file_states(out_dir: str) -> dict[str, tuple[int, int, int]]:
    """(inode, size, mtime) of each weight file in ``out_dir``: taken before a save, it tells which files the
    save wrote (``written_since``)."""
    if not os.path.isdir(out_dir):
        return {}
    states = {}
    for name in os.listdir(out_dir):
        path = os.path.join(out_dir, name)
        if any(fnmatch.fnmatch(name, pattern) for pattern in WEIGHT_FILES) and os.path.isfile(path):
            st = os.stat(path)
            states[name] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return states


def written_since(out_dir: str, before: dict[str, tuple[int, int, int]]) -> set[str]:
    return {name for name, state in weight_file_states(out_dir).items() if before.get(name) != state}
