"""The streaming and packing-at-scale halves of the data benchmark (``python -m roll.bench.data``).

``--stream-mb 100,1000``: how long a streamed pt corpus takes to the rows of step 1, and whether memory stays
flat as the corpus grows. For each size it writes a ``.jsonl`` corpus of ``{"text": ...}`` documents (random
words; about 3.5 KB each), then starts the data side of a streamed pt run in its own process (tokenizer,
``build_datasets`` with ``streaming: true`` and ``packing``, then the first global batch's rows, as step 1
reads them): ``step1_s`` is the whole start as a user waits for it, ``cpu_s`` the worker's CPU seconds (about
its wall time on an idle core), ``data_s`` the part from ``build_datasets`` to the last row of the first
batch, ``rows_tokenized`` the ``cutoff_len``-token rows the stream tokenized to get there (the shuffle buffer,
then the first packing block), ``fill`` the share of step 1's ``global_batch * cutoff_len`` token slots that
hold tokens (packing efficiency of the first block), ``anon_mb`` the peak anonymous memory. A corpus is deleted after its start unless
``--keep-corpus``.

``--pack-rows 2000000``: packing (first start) and loading the packed file (warm start) of that many generated
tokenized rows, memory-mapped, without the tokenizer pass (hours for 2M rows on a loaded 2-core machine).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

DOCS_IN_POOL = 4096


def write_corpus(path: str, megabytes: int, seed: int = 0) -> int:
    """At least ``megabytes`` MiB of pt documents (``{"text": ...}`` lines, each made unique by its number);
    returns the document count. The words come from a pool of documents, so writing 1 GiB takes seconds."""
    import numpy as np

    from roll.bench.data import WORDS

    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    sizes = rng.integers(200, 1000, DOCS_IN_POOL)
    pool = [" ".join(words[rng.integers(0, len(words), int(n))]) for n in sizes]
    target, written, docs = megabytes << 20, 0, 0
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as handle:
        while written < target:
            line = json.dumps({"text": f"document {docs}. {pool[docs % DOCS_IN_POOL]}"}) + "\n"
            handle.write(line)
            written += len(line)
            docs += 1
    os.replace(partial, path)
    return docs


def stream_build(spec: dict) -> dict:
    """One streamed start's data side (run in the worker process)."""
    from roll.config.data import DataArguments
    from roll.config.model import ModelArguments
    from roll.data import build_datasets, load_tokenizer
    from roll.data import streaming

    tokenized = [0]
    tokenized_rows = streaming.tokenized_rows

    def counted(*args, **kwargs):
        for row in tokenized_rows(*args, **kwargs):
            tokenized[0] += 1
            yield row

    streaming.tokenized_rows = counted
    data_args = DataArguments(dataset=spec["data"], cutoff_len=spec["cutoff_len"], packing=True,
                              streaming=True, buffer_size=spec["buffer_size"])
    tokenizer = load_tokenizer(ModelArguments(model_name_or_path=spec["tokenizer"]), data_args)
    start = time.perf_counter()
    bundle = build_datasets(data_args, tokenizer, stage="pt", processor="pretrain", formats=("text",), seed=0)
    streaming.set_stream_length(bundle.train, 1, spec["global_batch"])
    rows = [bundle.train[i] for i in range(spec["global_batch"])]
    return {"data_s": time.perf_counter() - start, "rows_tokenized": tokenized[0],
            "tokens": sum(len(r["input_ids"]) for r in rows)}


def run_streams(opts) -> list[dict]:
    results = []
    for megabytes in opts.stream_mb:
        folder = os.path.join(opts.work_dir, f"corpus_{megabytes}mb")
        os.makedirs(folder, exist_ok=True)
        corpus = os.path.join(folder, "corpus.jsonl")
        began = time.perf_counter()
        docs = write_corpus(corpus, megabytes)
        written_s = time.perf_counter() - began
        spec = {"runner": "roll-stream", "data": corpus, "tokenizer": opts.tokenizer,
                "cutoff_len": opts.cutoff_len, "buffer_size": opts.buffer_size,
                "global_batch": opts.global_batch, "out_dir": folder}
        spec_path = os.path.join(folder, "spec.json")
        with open(spec_path, "w", encoding="utf-8") as handle:
            json.dump(spec, handle)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        began = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "roll.bench.data", "--worker", spec_path], env=env,
                              capture_output=True, text=True, timeout=opts.timeout)
        row = {"runner": "roll", "corpus_mb": megabytes, "documents": docs, "write_s": round(written_s, 1),
               "step1_s": round(time.perf_counter() - began, 2), "buffer_size": opts.buffer_size,
               "global_batch": opts.global_batch}
        out = os.path.join(folder, "rank0.json")
        if proc.returncode != 0 or not os.path.isfile(out):
            row["status"] = f"failed (exit {proc.returncode}): {(proc.stderr or proc.stdout)[-600:]}"
        else:
            with open(out, encoding="utf-8") as handle:
                measure = json.load(handle)
            row.update(status="ok", data_s=round(measure["data_s"], 2),
                       rows_tokenized=measure["rows_tokenized"], tokens=measure["tokens"],
                       fill=round(measure["tokens"] / (opts.global_batch * opts.cutoff_len), 4),
                       cpu_s=round(measure["cpu_s"], 1),
                       anon_mb=round(measure["anon_bytes"] / 2**20))
        if not opts.keep_corpus:
            shutil.rmtree(folder, ignore_errors=True)
        results.append(row)
        sys.stderr.write(json.dumps(row) + "\n")
    return results


def stream_markdown(results: list[dict]) -> str:
    lines = ["| corpus MB | documents | to step 1 s | CPU s | data s | rows tokenized | fill | anon MB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("status") != "ok":
            lines.append(f"| {r['corpus_mb']} | {r['documents']} | {r['status'][:160]} | | | | | |")
            continue
        lines.append(f"| {r['corpus_mb']} | {r['documents']} | {r['step1_s']} | {r['cpu_s']} | {r['data_s']} "
                     f"| {r['rows_tokenized']} | {r['fill']} | {r['anon_mb']} |")
    return "\n".join(lines) + "\n"


def write_tokenized(path: str, rows: int, seed: int = 0) -> None:
    """``rows`` tokenized sft rows (``input_ids``, ``attention_mask``, ``labels``; 30-400 tokens, about 170 on
    average like the generated alpaca rows) as an Arrow file, written in batches: the input of packing at a
    size whose tokenization this machine cannot afford."""
    import numpy as np
    import pyarrow as pa
    from datasets import Features, Sequence, Value
    from datasets.arrow_writer import ArrowWriter

    rng = np.random.default_rng(seed)
    ints = Sequence(Value("int32"))
    features = Features({"input_ids": ints, "attention_mask": ints, "labels": ints})
    with ArrowWriter(features=features, path=f"{path}.partial") as writer:
        for start in range(0, rows, 100_000):
            lengths = np.clip(rng.normal(170, 60, min(100_000, rows - start)), 30, 400).astype(np.int32)
            offsets = pa.array(np.r_[0, np.cumsum(lengths)].astype(np.int32))
            ids = pa.array(rng.integers(3, 150_000, int(lengths.sum()), dtype=np.int32))
            column = pa.ListArray.from_arrays(offsets, ids)
            ones = pa.ListArray.from_arrays(offsets, pa.array(np.ones(int(lengths.sum()), np.int32)))
            writer.write_table(pa.table({"input_ids": column, "attention_mask": ones, "labels": column}))
        writer.finalize()
    os.replace(f"{path}.partial", path)


def pack_build(spec: dict) -> dict:
    """Pack (first start) or load the packed file (warm start) of a tokenized Arrow file, memory-mapped."""
    import datasets

    from roll.data.packing import pack_dataset

    start = time.perf_counter()
    tokenized = datasets.Dataset.from_file(spec["data"])
    packed, efficiency = pack_dataset(tokenized, spec["cutoff_len"])
    _ = packed[:64]
    return {"data_s": time.perf_counter() - start, "packed_rows": len(packed), "efficiency": efficiency}


def run_pack(opts) -> list[dict]:
    """The packing of ``--pack-rows`` tokenized rows, first (packs) and warm (loads), each its own process."""
    folder = os.path.join(opts.work_dir, f"tokenized_{opts.pack_rows}")
    os.makedirs(folder, exist_ok=True)
    data = os.path.join(folder, "tokenized.arrow")
    if not os.path.isfile(data):
        write_tokenized(data, opts.pack_rows)
    cache = os.path.join(folder, "cache")
    shutil.rmtree(cache, ignore_errors=True)
    results = []
    for start in ("first", "warm"):
        spec = {"runner": "roll-pack", "data": data, "cutoff_len": opts.cutoff_len, "out_dir": folder}
        spec_path = os.path.join(folder, "spec.json")
        with open(spec_path, "w", encoding="utf-8") as handle:
            json.dump(spec, handle)
        env = {**os.environ, "HF_DATASETS_CACHE": cache, "OMP_NUM_THREADS": "1"}
        began = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "roll.bench.data", "--worker", spec_path], env=env,
                              capture_output=True, text=True, timeout=opts.timeout)
        row = {"rows": opts.pack_rows, "start": start, "start_s": round(time.perf_counter() - began, 2)}
        if proc.returncode != 0:
            row["status"] = f"failed (exit {proc.returncode}): {(proc.stderr or proc.stdout)[-600:]}"
        else:
            with open(os.path.join(folder, "rank0.json"), encoding="utf-8") as handle:
                measure = json.load(handle)
            row.update(status="ok", data_s=round(measure["data_s"], 2), packed_rows=measure["packed_rows"],
                       efficiency=round(measure["efficiency"], 4), cpu_s=round(measure["cpu_s"], 1),
                       anon_mb=round(measure["anon_bytes"] / 2**20))
        results.append(row)
        sys.stderr.write(json.dumps(row) + "\n")
    return results
