"""Fingerprints of data: the content of a tokenized dataset (below), and the settings digests that name a
cached or saved result by what built it (``settings_digest``, ``tokenizer_digest``, ``code_digest``).

Each cache covers its own inputs on purpose: the tokenization cache (``roll.data.pipeline.fingerprint``) the
source rows, the processor settings, the tokenizer and the processing code; the packed rows
(``roll.data.packing.packed_fingerprint``) the tokenized rows, the bin size, the bin rule and the packing
code; ``tokenized_path`` (``roll.data.prepared.data_settings``) every row-changing key by name, so that a
refusal names each difference; a stream (``roll.data.streaming.fingerprint``) the data keys, the seed, the
tokenizer and a sample of each file. They share how a digest is taken.

The content fingerprint: the checkpoints of both backends record it (``roll.resume_record``), so that
resuming on a training set that changed since the checkpoint (another file, edited rows, other max_samples /
val_size / cutoff_len / template / seed) is refused instead of continuing a sample order that no longer
exists. It hashes what the model is trained on (every column's values and row lengths, rows in training
order), not file names or modification times: a copied or touched file with the same rows keeps the
fingerprint.
"""

from __future__ import annotations

import functools
import hashlib
import json

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


def settings_digest(*parts, length: int = 32) -> str:
    """sha256 (``length`` hex digits) of ``parts``: strings as they are, anything else as sorted-key JSON
    (``str`` for what JSON cannot hold); a separator between parts, so that no two part lists collide."""
    text = "\0".join(p if isinstance(p, str) else json.dumps(p, sort_keys=True, default=str) for p in parts)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def tokenizer_digest(tokenizer) -> str:
    """sha256 (16 hex digits) of what tokenization reads from the tokenizer: vocabulary and merges, chat
    template, special tokens. Two copies of one tokenizer in different folders agree."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return settings_digest(
        backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True),
        str(tokenizer.chat_template), str(tokenizer.eos_token_id), str(tokenizer.pad_token_id),
        str(tokenizer.bos_token_id), length=16)


@functools.lru_cache(maxsize=None)
def code_digest(*modules) -> str:
    """sha256 (16 hex digits) of the source files of ``modules``: a result they built is not reused once
    their code changed."""
    digest = hashlib.sha256()
    for module in modules:
        with open(module.__file__, "rb") as handle:
            digest.update(handle.read())
    return digest.hexdigest()[:16]
