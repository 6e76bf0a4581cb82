"""roll-bench's options and what it prepares once: the model (random init from a config, saved), the data
(plain text for the pt stage) and whether bf16 is worth running on this machine."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from roll.errors import ConfigError, DataError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_DATA = ("recipes/demo/data/arithmetic_pt.jsonl", "recipes/demo/data/arithmetic_sft.json",
             "recipes/demo/data/arithmetic_dpo.json")
"""Shipped with the repo, so a fresh clone can run the bench."""

SHAPES: dict[str, dict] = {
    # Tiny: for --quick and the smoke test (the 512-token BPE tokenizer of roll.demo.tiny_model).
    "tiny": dict(tokenizer="bpe", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    # The default: wide enough that the decoder is about a third of the FLOPs, not only the 151k head.
    "bench": dict(tokenizer="qwen", hidden_size=512, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2),
    # The real shapes (config.json of Qwen/Qwen2.5-0.5B and -1.5B), random weights: for GPU machines.
    "qwen2.5-0.5b": dict(tokenizer="qwen", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2),
    "qwen2.5-1.5b": dict(tokenizer="qwen", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2),
}
QWEN_VOCAB = 151936
"""Qwen2.5's embedding rows (the tokenizer's 151,665 ids padded), as in the released checkpoints."""
DEVICE_KINDS = ("cpu", "nvidia-h100", "nvidia-h200")


@dataclass
class BenchOptions:
    quick: bool = False
    full: bool = False
    steps: int = 3
    """Timed optimizer steps per case (after the warm-up)."""
    warmup: int = 2
    """Steps run but not timed (first steps allocate optimizer state and warm allocators)."""
    seqs: tuple[int, ...] = (256, 1024)
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    dtype_forced: bool = False
    """--dtype was given: run bf16 even where this machine's bf16 is slower than fp32."""
    tokens_per_step: int = 512
    only: tuple[str, ...] = ()
    model_shape: str = "bench"
    device_kind: str = "cpu"
    data: str | None = None
    threads: int | None = None
    timeout: float = 300.0
    dataloader_workers: int = 0
    work_dir: str = "outputs/bench"
    json_out: str = ""
    markdown_out: str = ""
    no_convert: bool = False
    no_saves: bool = False
    command: str = ""


def _csv(kind):
    return lambda text: tuple(kind(part) for part in text.split(",") if part)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="roll-bench", description="The speed ledger: plain HF Trainer vs the "
                                "standard and mca backends, and conversion throughput (docs/performance.md).")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny model, seq 64, 1+2 steps, fp32")
    p.add_argument("--full", action="store_true", help="every runner x dtype x seq x packing (slow on CPU)")
    p.add_argument("--steps", type=int, help="timed steps per case (default 3)")
    p.add_argument("--warmup", type=int, help="untimed first steps per case (default 2)")
    p.add_argument("--seq", type=_csv(int), dest="seqs", help="sequence lengths, e.g. 256,1024 or 4096")
    p.add_argument("--dtype", type=_csv(str), dest="dtypes", help="fp32,bf16")
    p.add_argument("--tokens-per-step", type=int,
                   help="global batch in tokens (rows = this // seq, at least one per rank; default 512)")
    p.add_argument("--only", type=_csv(str), help="run only cases whose name has one of these parts "
                   "(hf, standard, mca, 1p, DP2, TP2, fp32, s256, pack, ...) or is one of these names")
    p.add_argument("--model-shape", choices=sorted(SHAPES), help="default: bench (tiny with --quick)")
    p.add_argument("--device-kind", choices=DEVICE_KINDS, default="cpu", help="the machine this runs on")
    p.add_argument("--data", help="a .json/.jsonl file to train on instead of the repo's demo data")
    p.add_argument("--threads", type=int, help="torch threads per process (default: cores / processes)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per case before it is killed")
    p.add_argument("--dataloader-workers", type=int, default=0, help="dataloader_num_workers of every case")
    p.add_argument("--work-dir", default="outputs/bench", help="models, data and run directories")
    p.add_argument("--json-out", help="default: WORK_DIR/bench.json")
    p.add_argument("--markdown-out", help="default: docs/performance.md (WORK_DIR/bench.md with --quick)")
    p.add_argument("--no-convert", action="store_true", help="skip the conversion timings")
    p.add_argument("--no-saves", action="store_true", help="skip the checkpoint-save timings (sync vs async)")
    return p


def _as_written(word: str) -> str:
    """A command-line word as the ledger records it: an absolute path inside this checkout (``--work-dir
    /home/me/roll/outputs/bench``, or ``--json-out=...``) relative to it, so docs/performance.md names no
    user's directory and reruns from any clone; anything else as typed."""
    flag, equals, value = word.rpartition("=") if word.startswith("--") else ("", "", word)
    if not os.path.isabs(value):
        return word
    inside = os.path.relpath(os.path.realpath(value), os.path.realpath(REPO))
    if inside == os.pardir or inside.startswith(os.pardir + os.sep):
        return word
    return f"{flag}{equals}{inside}"


def parse_options(argv: list[str]) -> BenchOptions:
    args = _parser().parse_args(argv)
    opts = BenchOptions(quick=args.quick, full=args.full, device_kind=args.device_kind, data=args.data,
                        threads=args.threads, timeout=args.timeout,
                        dataloader_workers=args.dataloader_workers,
                        work_dir=args.work_dir, no_convert=args.no_convert, no_saves=args.no_saves,
                        only=args.only or (),
                        command=" ".join(["roll-bench", *map(_as_written, argv)]))
    if args.quick:
        opts.steps, opts.warmup, opts.seqs, opts.dtypes, opts.tokens_per_step = 2, 1, (64,), ("fp32",), 128
        opts.model_shape = "tiny"
    for name in ("steps", "warmup", "seqs", "dtypes", "tokens_per_step", "model_shape"):
        if getattr(args, name) is not None:
            setattr(opts, name, getattr(args, name))
    opts.dtype_forced = args.dtypes is not None
    opts.json_out = args.json_out or os.path.join(opts.work_dir, "bench.json")
    opts.markdown_out = args.markdown_out or (os.path.join(opts.work_dir, "bench.md") if args.quick
                                              else os.path.join(REPO, "docs", "performance.md"))
    _validate(opts)
    return opts


def _validate(opts: BenchOptions) -> None:
    if opts.quick and opts.full:
        raise ConfigError("--quick and --full exclude each other; pick one.")
    if opts.steps < 1 or opts.warmup < 0:
        raise ConfigError(f"--steps must be >= 1 and --warmup >= 0, got {opts.steps} and {opts.warmup}.")
    bad = [d for d in opts.dtypes if d not in ("fp32", "bf16")]
    if bad or not opts.dtypes:
        raise ConfigError(f"--dtype takes fp32 and/or bf16, got {','.join(opts.dtypes) or 'nothing'}.")
    if not opts.seqs or min(opts.seqs) < 8:
        raise ConfigError("--seq needs sequence lengths >= 8, e.g. --seq 256,1024.")
    if opts.data and not os.path.isfile(opts.data):
        raise ConfigError(f"--data {opts.data!r} is not a file.")
    if opts.device_kind != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"--device-kind {opts.device_kind} but torch sees no CUDA device; "
                              "use --device-kind cpu here.")


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            return next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    except OSError:
        return []


def bf16_support(device_kind: str, peaks: dict[str, dict], forced: bool = False,
                 flags: list[str] | None = None) -> tuple[bool, str]:
    """Whether bf16 cases are worth running here, and why. CPU: AMX (amx_bf16) makes bf16 matmuls faster
    than fp32; avx512_bf16 alone only converts and dot-products, so the measured peaks decide (``peaks``:
    bench_report.peak_flops). ``forced`` (bf16 named in --dtype) runs them anyway, reason recorded."""
    if device_kind != "cpu":
        return True, f"{device_kind}: bf16 tensor cores"
    flags = cpu_flags() if flags is None else flags
    if "amx_bf16" in flags:
        return True, "CPU has amx_bf16"
    fp32, bf16 = (peaks.get(k, {}).get("flops") for k in ("fp32", "bf16"))
    if "avx512_bf16" in flags and fp32 and bf16 and bf16 >= 0.9 * fp32:
        return True, f"CPU has avx512_bf16 and bf16 GEMMs run at {bf16 / fp32:.2f}x fp32"
    why = "CPU has avx512_bf16 but no AMX" if "avx512_bf16" in flags else "CPU has no bf16 instructions"
    if fp32 and bf16:
        why += f": a bf16 GEMM runs at {bf16 / 1e9:.0f} GFLOP/s vs fp32 {fp32 / 1e9:.0f} (probe)"
    return forced, why + ("; run anyway (--dtype names bf16)" if forced else ", so bf16 would be slower; "
                          "--dtype fp32,bf16 runs it anyway")


def prepare_model(out_dir: str, shape: str) -> tuple[str, dict]:
    """Random-init (seed 0) Qwen2 model of ``shape`` with its tokenizer, saved once; (dir, config dict)."""
    import torch
    import transformers

    from roll.demo import tiny_model as tiny

    if os.path.isfile(os.path.join(out_dir, "config.json")) and _same_shape(out_dir, shape):
        with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as fh:
            return out_dir, json.load(fh)
    spec = dict(SHAPES[shape])
    tok = tiny.build_bpe_tokenizer() if spec.pop("tokenizer") == "bpe" else tiny.load_qwen_tokenizer()
    vocab = len(tok) if len(tok) < 1000 else QWEN_VOCAB
    config = transformers.Qwen2Config(vocab_size=vocab, max_position_embeddings=32768,  # as Qwen2.5
                                      tie_word_embeddings=True, rms_norm_eps=1e-6, **spec)
    config.pad_token_id, config.eos_token_id, config.bos_token_id = tok.pad_token_id, tok.eos_token_id, None
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "bench_shape.txt"), "w", encoding="utf-8") as fh:
        fh.write(shape)
    return out_dir, config.to_dict()


def _same_shape(out_dir: str, shape: str) -> bool:
    path = os.path.join(out_dir, "bench_shape.txt")
    return os.path.isfile(path) and open(path, encoding="utf-8").read().strip() == shape


def _texts(value) -> list[str]:
    """Every string inside a row (alpaca fields, chat turns' contents), in order."""
    if isinstance(value, str):
        return [value] if value.strip() else []
    if isinstance(value, dict):
        return [t for v in value.values() for t in _texts(v)]
    if isinstance(value, list):
        return [t for v in value for t in _texts(v)]
    return []


def _rows(path: str) -> list:
    with open(path, encoding="utf-8") as fh:
        if path.endswith(".jsonl"):
            return [json.loads(line) for line in fh if line.strip()]
        data = json.load(fh)
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of rows (or a .jsonl file).")
    return data


def prepare_data(out_path: str, opts: BenchOptions, source: str | None) -> str:
    """A pt data set (``{"text": ...}`` rows): every string of each source row joined into one document.

    The demo files are short (tens of tokens per row), so their documents are repeated until there are
    enough tokens for every step at the longest sequence, about 4x over: without packing the pt stage
    concatenates the text and cuts it into full ``seq``-token rows (this is how seq 1024 without packing
    gets long rows); with packing each document stays whole and rows are filled best-fit."""
    paths = [source] if source else [os.path.join(REPO, p) for p in DEMO_DATA]
    docs = [" ".join(_texts(row)) for path in paths for row in _rows(path)]
    docs = [d for d in docs if d]
    if not docs:
        raise DataError(f"no text found in {', '.join(paths)}.")
    rows = max(2, opts.tokens_per_step // min(opts.seqs))
    need_chars = 4 * 4 * max(opts.seqs) * (opts.steps + opts.warmup) * rows  # ~4 chars a token, 4x over
    have = sum(len(d) for d in docs)
    repeats = max(1, -(-need_chars // have))
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as fh:
        for _ in range(repeats):
            for doc in docs:
                fh.write(json.dumps({"text": doc}) + "\n")
    return out_path


__all__ = ["BenchOptions", "SHAPES", "parse_options", "prepare_model", "prepare_data", "bf16_support"]
