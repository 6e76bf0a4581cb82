"""The shared data pipeline: loading, formats, chat templates, stage processors, collators, packing.

Both backends consume exactly what this package builds (see docs/data.md for the row schema).
"""

from roll.data.collators import PairwiseCollator, SequenceCollator, build_collator, shift_labels
from roll.data.pipeline import DatasetBundle, build_datasets
from roll.data.policy import SEQUENCE_KEYS, PaddingPolicy
from roll.data.stats import PreprocessStats
from roll.data.tokenizer import load_tokenizer

__all__ = ["DatasetBundle", "PaddingPolicy", "PairwiseCollator", "PreprocessStats", "SEQUENCE_KEYS",
           "SequenceCollator", "build_collator", "build_datasets", "load_tokenizer", "shift_labels"]
