"""A content fingerprint of a tokenized dataset, in its sample order.

The checkpoints of both backends record it (``roll.resume_record``), so that resuming on a training set that
changed since the checkpoint (another file, edited rows, other max_samples / val_size / cutoff_len /
template / seed) is refused instead of continuing a sample order that no longer exists. It hashes what the
model is trained on (every column's values and row lengths, rows in training order), not file names or
modification times: a copied or touched file with the same rows keeps the fingerprint.
"""

from __future__ import annotations

import hashlib

ROWS_PER_BATCH = 8192

_CACHE: dict[tuple[int, str], str] = {}
"""(id(dataset), datasets' own fingerprint) -> ours: a run hashes its training set once."""


def dataset_fingerprint(dataset) -> str:
    """sha256 (hex, 16 digits) of ``dataset``'s columns, in sorted column order, row by row."""
    if getattr(dataset, "streamed", False):  # a stream cannot be read whole: roll.data.streaming.fingerprint
        return dataset.stream_fingerprint()
    key = (id(dataset), getattr(dataset, "_fingerprint", ""))
    if key not in _CACHE:
        digest = hashlib.sha256()
        columns = sorted(dataset.column_names)
        digest.update(repr(columns).encode())
        for batch in dataset.with_format("arrow").iter(batch_size=ROWS_PER_BATCH):
            for name in columns:
                _update(digest, batch.column(name).combine_chunks())
        _CACHE[key] = digest.hexdigest()[:16]
    return _CACHE[key]


def _update(digest, array) -> None:
    """Hash an Arrow array's logical values (independent of its chunking, slicing and offsets)."""
    import pyarrow as pa

    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        digest.update(array.value_lengths().fill_null(-1).to_numpy(zero_copy_only=False).tobytes())
        _update(digest, array.flatten())
    elif pa.types.is_integer(array.type) or pa.types.is_floating(array.type) or pa.types.is_boolean(array.type):
        digest.update(array.fill_null(0).to_numpy(zero_copy_only=False).tobytes())
    else:
        digest.update(repr(array.to_pylist()).encode())
