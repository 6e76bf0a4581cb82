"""roll's named templates against LLaMA-Factory's own data code, row by row: token ids and labels of the same
generated rows, for each template name and stage (sft, kto, dpo), with function calls, observations and tool lists.

usage: python scripts/compare_llamafactory_rows.py [--lf-python lf/bin/python] [--rows 200] [--cutoff-len 4096]
           [--templates qwen,llama3,...] [--stages sft,kto,dpo] [--no-tools] [--work-dir /tmp/lf-rows]

LLaMA-Factory runs in its own virtual environment (``bash scripts/llamafactory_venv.sh lf``): this script runs
itself there with ``--lf-worker`` through roll.parity.llamafactory_worker (LLaMA-Factory's get_train_args,
load_tokenizer, get_template_and_fix_tokenizer and get_dataset, as its ``run_sft`` / ``run_kto`` call them), and
roll's processors here, on the same file and tokenizer (the Qwen2.5 tokenizer, with llama3's and glm4's special
tokens added for those names). It prints one line per template and stage and exits 1 on any difference. kto:
LLaMA-Factory pairs row i's prompt with row i-1's reply in its tokenization batch, which is roll's rotation
(roll.data.feedback.mismatched_rows) over the whole file taken as one micro-batch; a KL row is compared only when
neither of its two rows was truncated (roll forms it from the kept tokens). No test runs this script:
LLaMA-Factory is no dependency of roll.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATES = ("default", "empty", "chatml", "qwen", "qwen3", "qwen3_nothink", "llama3", "mistral", "deepseek3", "glm4")
"""roll's names but qwen2_vl, which LLaMA-Factory reads only with a multimodal processor (its text layout is qwen's
with another default system prompt)."""
FAMILY_SPECIALS = {"llama3": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                              "<|end_of_text|>"],
                   "glm4": ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]}
WORDS = ("the", "sum", "of", "two", "and", "three", "is", "five", "weather", "in", "Paris", "today", "sunny",
         "温度", "是", "🙂", "x=1", "{a}", "'q'", '"d"', "\n", "  ", "<b>", "tab\t", "ümlaut")
TOOLS = [{"name": "get_weather", "description": "The weather of a city.",
          "parameters": {"type": "object", "properties": {
              "city": {"type": "string", "description": "The city."},
              "unit": {"type": "string", "enum": ["c", "f"], "description": "Unit."}}, "required": ["city"]}},
         {"type": "function", "function": {"name": "add", "description": "Adds numbers.", "parameters": {
             "type": "object", "properties": {"xs": {"type": "array", "items": {"type": "number"},
                                                     "description": "Numbers."}}, "required": ["xs"]}}}]


def _text(rng: random.Random, lo: int = 1, hi: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).strip() or "ok"


def _call(rng: random.Random, parallel: bool, wrapped: bool) -> str:
    calls = [{"name": "get_weather", "arguments": {"city": _text(rng, 1, 2), "unit": "c"}},
             {"name": "add", "arguments": {"xs": [rng.randint(0, 9), 2.5]}}]
    if parallel:
        return json.dumps(calls, ensure_ascii=rng.random() < 0.5)
    content = json.dumps(rng.choice(calls), ensure_ascii=rng.random() < 0.5)
    if wrapped and rng.random() < 0.2:  # tool_call words around the JSON, a thought before it
        content = f"<think>\n{_text(rng)}\n</think>\n\n<tool_call>{content}</tool_call>"
    return content


def make_rows(n: int, seed: int, tools: bool, parallel: bool, wrapped: bool) -> list[dict]:
    """Conversations of 1-3 turns, with system prompts, thoughts, and (``tools``) tool lists, function calls
    (``parallel``: some with two calls; ``wrapped``: some in <tool_call> after a thought) and observations;
    a kto_tag each."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        turns = []
        for t in range(rng.randint(1, 3)):
            turns.append({"from": "human", "value": _text(rng)})
            if tools and rng.random() < 0.5:
                turns.append({"from": "function_call", "value": _call(rng, parallel and rng.random() < 0.3, wrapped)})
                turns.append({"from": "observation", "value": json.dumps({"result": _text(rng, 1, 3)})})
            reply = _text(rng)
            if rng.random() < 0.25:
                reply = f"<think>\n{_text(rng)}\n</think>\n\n{reply}"
            turns.append({"from": "gpt", "value": reply})
        if rng.random() < 0.3:
            turns.insert(0, {"from": "system", "value": _text(rng)})
        chosen = turns[-1] if not (tools and rng.random() < 0.3) else {"from": "function_call",
                                                                        "value": _call(rng, False, wrapped)}
        row = {"conversations": turns, "kto_tag": i % 3 != 0, "chosen": chosen,
               "rejected": {"from": "gpt", "value": "not " + _text(rng)}}
        if tools:
            row["tools"] = json.dumps(rng.sample(TOOLS, rng.randint(1, 2)), ensure_ascii=False) if rng.random() < 0.8 \
                else ""
        rows.append(row)
    return rows


# ---- LLaMA-Factory's side (run in its own environment) ------------------------------------------------------

def lf_worker(spec_path: str) -> None:
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    spec = json.load(open(spec_path, encoding="utf-8"))
    folder = os.path.dirname(spec["data"])
    columns = {"messages": "conversations", **{"kto": {"kto_tag": "kto_tag"}, "dpo": {
        "chosen": "chosen", "rejected": "rejected"}}.get(spec["stage"], {})}
    if spec["tools"]:
        columns["tools"] = "tools"
    with open(os.path.join(folder, "dataset_info.json"), "w", encoding="utf-8") as handle:
        json.dump({"rows": {"file_name": os.path.basename(spec["data"]), "formatting": "sharegpt",
                            "ranking": spec["stage"] == "dpo", "columns": columns}}, handle)
    model_args, data_args, training_args, _, _ = get_train_args(dict(
        model_name_or_path=spec["tokenizer"], stage=spec["stage"], do_train=True, finetuning_type="full",
        dataset="rows", dataset_dir=folder, template=spec["template"], cutoff_len=spec["cutoff_len"],
        output_dir=spec["out"], overwrite_output_dir=True, overwrite_cache=True, report_to="none",
        enable_thinking=spec["enable_thinking"]))
    tokenizer_module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    stage = "rm" if spec["stage"] == "dpo" else spec["stage"]  # its run_dpo reads pairs as stage rm's
    train = get_dataset(template, model_args, data_args, training_args, stage=stage,
                        **tokenizer_module)["train_dataset"]
    keys = [k for k in ("input_ids", "labels", "kl_input_ids", "kl_labels", "kto_tags", "chosen_input_ids",
                        "chosen_labels", "rejected_input_ids", "rejected_labels") if k in train.column_names]
    with open(spec["out_json"], "w", encoding="utf-8") as handle:
        json.dump({k: list(train[k]) for k in keys}, handle)


# ---- roll's side -----------------------------------------------------------------------------------------------

def roll_rows(spec: dict) -> dict:
    from roll.config.data import DataArguments
    from roll.config.model import ModelArguments
    from roll.data import load_tokenizer
    from roll.data.feedback import FeedbackProcessor, mismatched_rows
    from roll.data.named_templates import encoder_for
    from roll.data.processors import PairwiseProcessor, SupervisedProcessor

    data_args = DataArguments(template=spec["template"], enable_thinking=spec["enable_thinking"])
    tokenizer = load_tokenizer(ModelArguments(model_name_or_path=spec["tokenizer"]), data_args)
    rows = [json.loads(line) for line in open(spec["data"], encoding="utf-8")]
    batch = {k: [row.get(k) for row in rows] for k in sorted({k for row in rows for k in row})}
    cls = {"kto": FeedbackProcessor, "dpo": PairwiseProcessor}.get(spec["stage"], SupervisedProcessor)
    fmt = "pairwise" if spec["stage"] == "dpo" else "sharegpt"
    out = cls(tokenizer, spec["cutoff_len"], fmt, spec["data"], encoder=encoder_for(data_args))(
        batch, list(range(len(rows))))
    assert all(reason == "" for reason in out["_drop"]), out["_drop"]
    if spec["stage"] == "dpo":
        return {k: out[k] for k in ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")}
    result = {"input_ids": out["input_ids"], "labels": out["labels"], "truncated": out["_truncated"]}
    if spec["stage"] == "kto":
        features = [{"input_ids": i, "labels": lab} for i, lab in zip(out["input_ids"], out["labels"])]
        kl = mismatched_rows(features, spec["cutoff_len"], named_template=True)
        result.update(kl_input_ids=[r["input_ids"] for r in kl], kl_labels=[r["labels"] for r in kl],
                      kto_tags=out["kto_tag"])
    return result


def differences(lf: dict, roll: dict, stage: str) -> tuple[int, int, int, list[str]]:
    """(rows compared, rows that differ, KL rows compared, the first few differences)."""
    sides = ("chosen_", "rejected_") if stage == "dpo" else ("",)
    n, bad, kl_rows, notes = len(roll[f"{sides[0]}input_ids"]), 0, 0, []
    if len(lf[f"{sides[0]}input_ids"]) != n:
        return n, n, 0, [f"LLaMA-Factory kept {len(lf[sides[0] + 'input_ids'])} rows, roll {n}"]
    for i in range(n):
        keys = []
        for side in sides:
            labels = list(lf[f"{side}labels"][i])
            labels[:1] = [-100]  # roll never trains the first position (nothing predicts it)
            keys += [(f"{side}input_ids", lf[f"{side}input_ids"][i]), (f"{side}labels", labels)]
        if stage == "kto":
            keys.append(("kto_tags", lf["kto_tags"][i]))
            if not (roll["truncated"][i] or roll["truncated"][i - 1]):
                kl_labels = list(lf["kl_labels"][i])
                kl_labels[:1] = [-100]
                keys += [("kl_input_ids", lf["kl_input_ids"][i]), ("kl_labels", kl_labels)]
                kl_rows += 1
        wrong = [k for k, v in keys if roll[k][i] != v]
        if wrong:
            bad += 1
            if len(notes) < 3:
                notes.append(f"row {i}: {', '.join(wrong)} differ")
    return n, bad, kl_rows, notes


def _tokenizers(work: str) -> dict[str, str]:
    from roll.demo.tiny_model import load_qwen_tokenizer

    out = {}
    for name in ("qwen", *FAMILY_SPECIALS):
        tokenizer = load_qwen_tokenizer()
        tokenizer.bos_token = "<|endoftext|>"  # Qwen has none; templates with a BOS slot write one
        if name in FAMILY_SPECIALS:
            tokenizer.add_special_tokens({"additional_special_tokens": FAMILY_SPECIALS[name]})
        out[name] = os.path.join(work, f"tokenizer-{name}")
        tokenizer.save_pretrained(out[name])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lf-python", default=os.path.join(ROOT, "lf", "bin", "python"))
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--cutoff-len", type=int, default=4096)
    parser.add_argument("--templates", default=",".join(TEMPLATES))
    parser.add_argument("--stages", default="sft,kto,dpo")
    parser.add_argument("--no-tools", action="store_true", help="rows without tool lists and function calls")
    parser.add_argument("--enable-thinking", default="true", choices=("true", "false"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--lf-worker", help=argparse.SUPPRESS)  # roll.parity.llamafactory_worker runs it
    opts = parser.parse_args()
    if opts.lf_worker:
        lf_worker(opts.lf_worker)
        return 0
    from roll.parity.llamafactory_worker import WorkerFailed, missing_python, run_worker

    problem = missing_python(opts.lf_python)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    work = opts.work_dir or tempfile.mkdtemp(prefix="lf-rows-")
    tokenizers = _tokenizers(work)
    failed = 0
    for template in opts.templates.split(","):
        tools = not opts.no_tools
        # glm4 has no parallel calls; mistral's template (LLaMA-Factory's Llama2Template) reads a call as JSON only
        rows = make_rows(opts.rows, opts.seed, tools, parallel=template != "glm4", wrapped=template != "mistral")
        for stage in opts.stages.split(","):
            case = os.path.join(work, f"{template}-{stage}")
            os.makedirs(case, exist_ok=True)
            data = os.path.join(case, "rows.jsonl")
            staged = [{**row, "conversations": row["conversations"][:-1]} for row in rows] if stage == "dpo" else rows
            with open(data, "w", encoding="utf-8") as handle:  # dpo: the conversation is the prompt
                handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in staged)
            spec = {"data": data, "tokenizer": tokenizers.get(template, tokenizers["qwen"]), "stage": stage,
                    "template": template, "cutoff_len": opts.cutoff_len, "tools": tools,
                    "enable_thinking": opts.enable_thinking == "true"}
            try:
                lf = run_worker(opts.lf_python, __file__, spec, case)
            except WorkerFailed as exc:
                print(f"{template:14s} {stage:4s} LLaMA-Factory failed: {exc.stderr[-400:]}")
                failed += 1
                continue
            n, bad, kl_rows, notes = differences(lf, roll_rows(spec), stage)
            failed += bad > 0
            kl = f" (and {kl_rows} KL rows)" if stage == "kto" else ""
            print(f"{template:14s} {stage:4s} {n} rows{kl}, {bad} differ" + (f": {'; '.join(notes)}" if notes else ""),
                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
