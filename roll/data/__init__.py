"""The shared data pipeline: loading, formats, chat templates, stage processors, collators, packing.

Both backends consume exactly what this package builds (see docs/data.md for the row schema).
Attributes are imported lazily: ``backends.base`` imports ``roll.data.policy`` during config
validation, which must not pull in torch or datasets.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DatasetBundle": "roll.data.pipeline",
    "build_datasets": "roll.data.pipeline",
    "PairwiseCollator": "roll.data.collators",
    "SequenceCollator": "roll.data.collators",
    "build_collator": "roll.data.collators",
    "shift_labels": "roll.data.collators",
    "PaddingPolicy": "roll.data.policy",
    "SEQUENCE_KEYS": "roll.data.policy",
    "PreprocessStats": "roll.data.stats",
    "load_tokenizer": "roll.data.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'roll.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
