"""Regenerate the demo datasets under recipes/demo/data/ (small enough that a tiny model visibly learns them).

usage: python scripts/make_demo_data.py
"""

import json
import os
import random

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "demo", "data")


def main() -> None:
    rng = random.Random(0)
    os.makedirs(OUT, exist_ok=True)
    pairs = [(a, b) for a in range(10) for b in range(10)]
    rng.shuffle(pairs)
    sft = [{"instruction": f"What is {a} plus {b}?", "input": "", "output": f"{a} plus {b} equals {a + b}."}
           for a, b in pairs]
    dpo = [{"conversations": [{"from": "human", "value": f"What is {a} plus {b}?"}],
            "chosen": {"from": "gpt", "value": f"{a} plus {b} equals {a + b}."},
            "rejected": {"from": "gpt", "value": f"{a} plus {b} equals {a + b + rng.randint(1, 5)}."}}
           for a, b in pairs[:64]]
    text = [{"text": f"{a} plus {b} equals {a + b}. {b} plus {a} equals {a + b}."} for a, b in pairs]
    rm = reward_pairs(pairs)
    for name, rows in (("arithmetic_sft.json", sft), ("arithmetic_dpo.json", dpo), ("arithmetic_rm.json", rm)):
        with open(os.path.join(OUT, name), "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
    with open(os.path.join(OUT, "arithmetic_pt.jsonl"), "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in text)
    with open(os.path.join(OUT, "arithmetic_kto.json"), "w", encoding="utf-8") as fh:
        json.dump(kto_rows(pairs[:64]), fh, indent=1)


def kto_rows(pairs: list[tuple[int, int]]) -> list[dict]:
    """stage kto's rows (LLaMA-Factory's kto_tag format, sharegpt messages): each question once, answered right
    (kto_tag true) or wrong (false), about 5 right to 3 wrong (its own generator: the other files stay as
    they are)."""
    rng = random.Random(1)
    rows = []
    for a, b in pairs:
        right = rng.random() < 0.6
        answer = a + b if right else a + b + rng.randint(1, 5)
        rows.append({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                  {"role": "assistant", "content": f"{a} plus {b} equals {answer}."}],
                     "kto_tag": right})
    return rows


def reward_pairs(pairs: list[tuple[int, int]]) -> list[dict]:
    """Stage rm's demo pairs, in alpaca's pairwise form (instruction / input / chosen / rejected): every sum once,
    the rejected answer off by 1 to 3 either way (its own generator: the other files stay as they were)."""
    rng = random.Random(1)
    rows = []
    for a, b in pairs:
        wrong = a + b + rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if a + b + d >= 0])
        rows.append({"instruction": f"What is {a} plus {b}?", "input": "",
                     "chosen": f"{a} plus {b} equals {a + b}.", "rejected": f"{a} plus {b} equals {wrong}."})
    return rows


if __name__ == "__main__":
    main()
