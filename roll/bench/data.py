"""roll-bench's data mode (``python -m roll.bench.data``): how fast the data pipeline starts and how much
memory each rank holds, on generated alpaca rows (issue 28's measure).

For each row count (20k by default; ``--rows 20000,200000`` or 2M on request) it writes the rows once and,
on one fresh datasets cache, starts the data side of a run (tokenizer + ``build_datasets``, as ``build_job``
does) in this order: unpacked first start (tokenizes), unpacked warm start, packed first start (tokens
cached, packs), packed warm start, then the same with 2 ranks (torchrun + gloo; the packed file deleted
first so that local rank 0 packs and the other rank loads). Each start is its own process tree; it reports:
- ``start_s``: wall seconds of the whole command (imports, tokenizer, data), as a user waits for it;
- ``data_s``: seconds inside ``build_datasets`` (the slowest rank), ``pack_s``: of them, writing packed rows;
- ``rows_per_s``: rows / data_s; ``anon_mb``: peak anonymous memory of the largest rank (RssAnon of the rank
  and its map workers, summed, sampled every 50 ms from /proc: what the dataset costs a rank, page cache of
  memory-mapped files not included).
LLaMA-Factory runs side by side (its ``get_dataset``, same rows, cutoff and packing) when it is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

WORDS = ("the of and to in is that for it as with was on be by this are from at or an have not they which "
         "one you had her all she there would their we him been has when who will more no if out so said "
         "what up its about into than them can only other new some could time these two may then do first "
         "any my now such like our over man me even most made after also did many before must through back "
         "years where much your way well down should because each just those people how too little state "
         "good very make world still own see men work long get here between both life being under never "
         "day same another know while last might us great old year off come since against go came right "
         "used take three").split()


def write_rows(path: str, rows: int, seed: int = 0) -> None:
    """``rows`` alpaca rows of random words (instruction 5-60, input 0-40 half the time, output 10-200 words:
    about 170 tokens a row with Qwen2.5's tokenizer), written once."""
    import numpy as np

    if os.path.isfile(path):
        return
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as handle:
        for start in range(0, rows, 10000):
            n = min(10000, rows - start)
            sizes = np.stack([rng.integers(5, 61, n), rng.integers(0, 41, n) * rng.integers(0, 2, n),
                              rng.integers(10, 201, n)], axis=1)
            picks = rng.integers(0, len(words), int(sizes.sum()))
            cursor = 0
            for a, b, c in sizes.tolist():
                parts = []
                for size in (a, b, c):
                    parts.append(" ".join(words[picks[cursor:cursor + size]]))
                    cursor += size
                row = {"instruction": parts[0], "input": parts[1], "output": parts[2]}
                handle.write(json.dumps(row) + "\n")
    os.replace(partial, path)


class AnonSampler:
    """Peak RssAnon (bytes) of this process plus its descendants, sampled every ``interval`` seconds."""

    def __init__(self, interval: float = 0.05) -> None:
        self.peak, self.interval = 0, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, sum(rss_anon(pid) for pid in tree(os.getpid())))
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=5)
        self.peak = max(self.peak, sum(rss_anon(pid) for pid in tree(os.getpid())))
        return self.peak


def rss_anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree(pid: int) -> list[int]:
    """``pid`` and every descendant (from /proc/PID/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children", encoding="ascii") as handle:
                    todo += [int(child) for child in handle.read().split()]
        except OSError:
            continue
    return out


def worker(spec_path: str) -> None:
    """One rank of one start: build the data as roll-train does and write this rank's measures."""
    sampler = AnonSampler()
    with open(spec_path, encoding="utf-8") as handle:
        spec = json.load(handle)
    rank = int(os.environ.get("RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    if spec["runner"] in ("roll-stream", "roll-pack"):
        from roll.bench.data_stream import pack_build, stream_build

        result = (stream_build if spec["runner"] == "roll-stream" else pack_build)(spec)
    else:
        result = _llamafactory_build(spec) if spec["runner"] == "llamafactory" else _roll_build(spec)
    result["anon_bytes"] = sampler.stop()
    result["cpu_s"] = time.process_time()  # this process's CPU seconds: its wall time on an idle core
    with open(os.path.join(spec["out_dir"], f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle)


def _roll_build(spec: dict) -> dict:
    from roll.config.data import DataArguments
    from roll.config.model import ModelArguments
    from roll.data import build_datasets, load_tokenizer, packing

    pack_seconds = []
    write_packed = packing._write_packed

    def timed(*args, **kwargs):
        start = time.perf_counter()
        write_packed(*args, **kwargs)
        pack_seconds.append(time.perf_counter() - start)

    packing._write_packed = timed
    data_args = DataArguments(dataset=spec["data"], cutoff_len=spec["cutoff_len"], packing=spec["packing"],
                              preprocessing_num_workers=spec["workers"])
    start = time.perf_counter()
    tokenizer = load_tokenizer(ModelArguments(model_name_or_path=spec["tokenizer"]), data_args)
    bundle = build_datasets(data_args, tokenizer, stage="sft", processor="supervised",
                            formats=("alpaca", "sharegpt"), seed=0)
    _ = bundle.train[:64]  # the first batches, as the dataloader reads them
    return {"data_s": time.perf_counter() - start, "pack_s": sum(pack_seconds),
            "train_rows": len(bundle.train)}


def _llamafactory_build(spec: dict) -> dict:
    """LLaMA-Factory's own data path (as its run_sft calls it) on the same rows and settings."""
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    folder = os.path.dirname(spec["data"])
    with open(os.path.join(folder, "dataset_info.json"), "w", encoding="utf-8") as handle:
        json.dump({"bench": {"file_name": os.path.basename(spec["data"])}}, handle)
    start = time.perf_counter()
    model_args, data_args, training_args, _, _ = get_train_args(dict(
        model_name_or_path=spec["tokenizer"], stage="sft", do_train=True, finetuning_type="full",
        dataset="bench", dataset_dir=folder, template="qwen", cutoff_len=spec["cutoff_len"],
        packing=spec["packing"], preprocessing_num_workers=spec["workers"], output_dir=spec["out_dir"],
        overwrite_output_dir=True, report_to="none"))
    tokenizer_module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    module = get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)
    train = module["train_dataset"]
    _ = train[:64]
    return {"data_s": time.perf_counter() - start, "pack_s": None, "train_rows": len(train)}


PLAN = [("off", 1, "first"), ("off", 1, "warm"), ("on", 1, "first"), ("on", 1, "warm"),
        ("off", 2, "warm"), ("on", 2, "first"), ("on", 2, "warm")]
"""(packing, ranks, start) in run order on one cache: 'first' tokenizes (unpacked) or packs (packed)."""


def run_start(runner: str, rows: int, packing: str, ranks: int, start: str, opts, data: str,
              cache: str) -> dict:
    out_dir = os.path.join(opts.work_dir, "runs", f"{runner}-{rows}-{packing}-{ranks}-{start}")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    spec = {"runner": runner, "data": data, "tokenizer": opts.tokenizer, "cutoff_len": opts.cutoff_len,
            "packing": packing == "on", "workers": opts.workers, "out_dir": out_dir}
    spec_path = os.path.join(out_dir, "spec.json")
    with open(spec_path, "w", encoding="utf-8") as handle:
        json.dump(spec, handle)
    if start == "first" and packing == "on" and runner == "roll":
        shutil.rmtree(os.path.join(cache, "roll-packed"), ignore_errors=True)
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                    "--standalone", f"--nproc_per_node={ranks}"]
    env = {**os.environ, "HF_DATASETS_CACHE": cache, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    began = time.perf_counter()
    if runner == "llamafactory" and opts.lf_python:  # its own environment; roll.bench.data from this tree
        launcher[0] = opts.lf_python
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    proc = subprocess.run([*launcher, "-m", "roll.bench.data", "--worker", spec_path], env=env,
                          capture_output=True, text=True, timeout=opts.timeout)
    row = {"runner": runner, "rows": rows, "packing": packing, "ranks": ranks, "start": start,
           "start_s": round(time.perf_counter() - began, 2)}
    ranks_out = [os.path.join(out_dir, f"rank{r}.json") for r in range(ranks)]
    if proc.returncode != 0 or not all(os.path.isfile(p) for p in ranks_out):
        return {**row, "status": f"failed (exit {proc.returncode}): {(proc.stderr or proc.stdout)[-600:]}"}
    measures = [json.load(open(p, encoding="utf-8")) for p in ranks_out]
    data_s = max(m["data_s"] for m in measures)
    packs = [m["pack_s"] for m in measures if m["pack_s"]]
    return {**row, "status": "ok", "data_s": round(data_s, 2), "pack_s": round(sum(packs), 2),
            "packing_ranks": len(packs), "rows_per_s": round(rows / data_s),
            "train_rows": measures[0]["train_rows"],
            "cpu_s": round(max(m.get("cpu_s", 0) for m in measures), 1),  # map workers' CPU not included
            "anon_mb": round(max(m["anon_bytes"] for m in measures) / 2**20)}


def run(opts) -> list[dict]:
    has_lf = _has_llamafactory(opts.lf_python)
    results = []
    for rows in opts.rows:
        data = os.path.join(opts.work_dir, f"alpaca_{rows}", "rows.jsonl")
        os.makedirs(os.path.dirname(data), exist_ok=True)
        write_rows(data, rows)
        for runner in opts.runners:
            if runner == "llamafactory" and not has_lf:
                results.append({"runner": runner, "rows": rows, "status": "skipped: llamafactory is not "
                                "installed in this environment (pip install llamafactory, or --lf-python)"})
                continue
            cache = os.path.join(opts.work_dir, f"cache-{runner}-{rows}")
            shutil.rmtree(cache, ignore_errors=True)
            plan = PLAN if runner == "roll" else [p for p in PLAN if p[1] == 1]
            for packing, ranks, start in plan:
                if ranks in opts.ranks:
                    results.append(run_start(runner, rows, packing, ranks, start, opts, data, cache))
                    sys.stderr.write(json.dumps(results[-1]) + "\n")  # progress: a 200k run takes minutes
    return results


def _has_llamafactory(python: str | None) -> bool:
    """Whether LLaMA-Factory imports here, or in ``python`` (``--lf-python``: its own environment)."""
    if python is None:
        import importlib.util

        return importlib.util.find_spec("llamafactory") is not None
    probe = subprocess.run([python, "-c", "import llamafactory"], capture_output=True, timeout=300)
    return probe.returncode == 0


def markdown(results: list[dict]) -> str:
    lines = ["| runner | rows | packing | ranks | start | start s | data s | pack s | rows/s "
             "| anon MB per rank |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("status") != "ok":
            lines.append(f"| {r['runner']} | {r['rows']} | {r.get('packing', '')} | {r.get('ranks', '')} | "
                         f"{r.get('start', '')} | {r['status'][:160]} | | | | |")
            continue
        lines.append(f"| {r['runner']} | {r['rows']} | {r['packing']} | {r['ranks']} | {r['start']} "
                     f"| {r['start_s']} | {r['data_s']} | {r['pack_s']} | {r['rows_per_s']} "
                     f"| {r['anon_mb']} |")
    return "\n".join(lines) + "\n" + "\n".join(targets(results)) + "\n"


def targets(results: list[dict]) -> list[str]:
    """Issue 28's targets per row and rank count: packed warm start and memory within 1.2x of unpacked."""
    ok = {(r["rows"], r["ranks"], r["packing"], r["start"]): r for r in results
          if r.get("status") == "ok" and r["runner"] == "roll"}
    lines = []
    for (rows, ranks, packing, start), packed in sorted(ok.items()):
        plain = ok.get((rows, ranks, "off", "warm"))
        if packing == "on" and start == "warm" and plain:
            time_ratio = packed["start_s"] / plain["start_s"]
            memory_ratio = packed["anon_mb"] / max(plain["anon_mb"], 1)
            lines.append(f"- {rows} rows, {ranks} rank(s): packed warm start {time_ratio:.2f}x the unpacked, "
                         f"anonymous memory {memory_ratio:.2f}x (targets: 1.2x)")
    return lines


def _csv_ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def parse(argv: list[str]):
    p = argparse.ArgumentParser(prog="python -m roll.bench.data", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=_csv_ints, default=[20000],
                   help="row counts, e.g. 20000,200000 (2000000 takes minutes and ~1 GB of disk; opt-in)")
    p.add_argument("--ranks", type=_csv_ints, default=[1, 2], help="rank counts to start (1 and/or 2)")
    p.add_argument("--cutoff-len", type=int, default=1024)
    p.add_argument("--workers", type=int, default=2, help="preprocessing_num_workers")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the Qwen2.5 tokenizer of roll's demo)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per start before it is killed")
    p.add_argument("--work-dir", default="outputs/bench-data")
    p.add_argument("--json-out", help="default: WORK_DIR/bench-data.json")
    p.add_argument("--stream-mb", type=_csv_ints, default=[],
                   help="instead: streamed pt corpora of these sizes in MiB (e.g. 100,1000), each to step "
                        "1's rows (roll/bench/data_stream.py); written under WORK_DIR and deleted after")
    p.add_argument("--pack-rows", type=int, default=0,
                   help="instead: pack this many generated tokenized rows (no tokenizer pass: packing 2M "
                        "rows where tokenizing them costs hours), first and warm start")
    p.add_argument("--buffer-size", type=int, default=16384, help="buffer_size of the streamed runs")
    p.add_argument("--global-batch", type=int, default=8, help="rows of step 1 in the streamed runs")
    p.add_argument("--keep-corpus", action="store_true", help="keep the streamed corpora")
    p.add_argument("--runners", type=lambda text: text.split(","), default=["roll", "llamafactory"],
                   help="which pipelines to start (default: roll,llamafactory)")
    p.add_argument("--lf-python", help="python of an environment with LLaMA-Factory installed (default: "
                                       "this one, when it has LLaMA-Factory)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    opts = parse(sys.argv[1:] if argv is None else argv)
    if opts.worker:
        worker(opts.worker)
        return
    if opts.tokenizer is None:
        from roll.demo.tiny_model import qwen_tokenizer_dir

        opts.tokenizer = qwen_tokenizer_dir()
    opts.work_dir = os.path.abspath(opts.work_dir)
    if opts.stream_mb:
        from roll.bench.data_stream import run_streams, stream_markdown

        results = run_streams(opts)
        text = stream_markdown(results)
    elif opts.pack_rows:
        from roll.bench.data_stream import run_pack

        results = run_pack(opts)
        text = "".join(json.dumps(row) + "\n" for row in results)
    else:
        results = run(opts)
        text = markdown(results)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "loadavg": os.getloadavg(),
              "cpus": os.cpu_count(), "command": " ".join(["python -m roll.bench.data", *sys.argv[1:]]),
              "results": results}
    json_out = opts.json_out or os.path.join(opts.work_dir, "bench-data.json")
    with open(json_out, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=1)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
