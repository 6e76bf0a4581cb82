"""Measure the gaps behind every parity and golden bound in tests/bounds.py, with the tests' own runs.

usage: OMP_NUM_THREADS=1 python scripts/measure_bounds.py [--case NAME ...] [--json OUT.json]

Each case runs exactly what its test runs (the same functions: tests/recipes, tests/distributed/test_mca_*.py,
test_parity_tool.py) on CPU in fp32 and builds the same comparisons; for every bound it prints the largest
relative gap over every step of every comparison held to it, where that gap is, and the bound's ratio to it.
It exits 1 when a gap comes within 3x of its bound (a flaky test) or a bound is more than 100x a gap (a bound
that a bug hides under); a bit-identical comparison counts as one fp32 rounding (1e-7) there. Cases:
goldens, backend, layouts, resume, eval, packed, lora, dpo, pref_losses, kto, moe_stages, rm, parity_tool, param_groups,
conversion, export (all by default; ~15 min on 2 idle cores).
Write a new measurement into tests/bounds.py with its date.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
for var, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
                   ("TOKENIZERS_PARALLELISM", "false"), ("DS_ACCELERATOR", "cpu")):
    os.environ.setdefault(var, value)

from tests import bounds  # noqa: E402
from tests.bounds import Bound, Comparison  # noqa: E402

ONE_ROUNDING = 1e-7
"""A bit-identical comparison's gap, for the too-loose check: about one fp32 rounding (2**-23)."""


def model_maker(root: Path):
    """``tiny_model_factory``'s equivalent: make(kind, **overrides) -> a tiny model dir, cached."""
    from roll.demo.tiny_model import make_tiny_model

    cache: dict[tuple, str] = {}

    def make(kind: str = "qwen2", tokenizer: str = "bpe", **overrides) -> str:
        key = (kind, tokenizer, tuple(sorted(overrides.items())))
        if key not in cache:
            out = root / f"model_{len(cache)}_{kind}"
            cache[key] = make_tiny_model(str(out), kind=kind, tokenizer=tokenizer, **overrides)
        return cache[key]

    return make


def case_goldens(make, root: Path) -> list[Comparison]:
    from tests.recipes.recipe_runs import RECIPES, run_all
    from tests.recipes.test_recipe_goldens import backend_comparison, golden_comparison

    losses = run_all(make("qwen2"), str(root))
    return [*(golden_comparison(name, backend, losses[name][backend]) for name in RECIPES
              for backend in ("standard", "mca")),
            *(backend_comparison(name, losses[name]["standard"], losses[name]["mca"]) for name in RECIPES)]


def case_backend(make, root: Path) -> list[Comparison]:
    from tests.distributed.test_mca_train import backend_comparisons, backend_runs

    return backend_comparisons(backend_runs(make("qwen2"), root))


def case_layouts(make, root: Path) -> list[Comparison]:
    from tests.distributed.test_mca_train import layout_comparisons, layout_runs

    return layout_comparisons(layout_runs(make, root))


def case_resume(make, root: Path) -> list[Comparison]:
    from tests.distributed.test_mca_train import resume_comparisons, resume_runs, shrunk_runs

    model = make("qwen2")
    return resume_comparisons(resume_runs(model, root), shrunk_runs(model, root))


def case_elastic_resume(make, root: Path) -> list[Comparison]:
    from tests.distributed.test_elastic_resume_dist import elastic_comparisons

    model = make("qwen2")
    return [comparison for ds_file in ("ds_z2.json", "ds_z3.json")
            for comparison in elastic_comparisons(model, root / ds_file, ds_file)]


def case_eval(make, root: Path) -> list[Comparison]:
    from tests.distributed.test_mca_train import eval_comparisons, eval_runs

    return eval_comparisons(*eval_runs(make("qwen2"), root))


def case_packed(make, root: Path) -> list[Comparison]:
    from tests.distributed.test_mca_train import packed_comparison, packed_runs

    comparisons = []
    for layout in ([], ["context_parallel_size=2"]):
        (root / str(len(layout))).mkdir()
        losses = packed_runs(make("qwen2"), root / str(len(layout)), layout)
        comparisons.append(packed_comparison(losses, layout))
    return comparisons


def case_lora(make, root: Path) -> list[Comparison]:
    from tests.distributed.test_mca_train import lora_comparisons, lora_runs

    return lora_comparisons(*lora_runs(make, root))


def case_dpo(make, root: Path) -> list[Comparison]:
    from tests.distributed.test_mca_dpo import dpo_comparisons, dpo_runs

    return dpo_comparisons(*dpo_runs(make, root))


def case_pref_losses(make, root: Path) -> list[Comparison]:
    from tests.distributed.test_mca_pref_losses_dist import pref_comparisons, pref_runs

    return pref_comparisons(*pref_runs(make, root))


def case_kto(make, root: Path) -> list[Comparison]:
    from roll.parity.cases import get_case
    from tests.parity.test_sweep import KTO_CASES, Sweep, kto_comparisons, kto_logs

    return kto_comparisons(kto_logs(Sweep(make, root, [get_case(name) for name in KTO_CASES])))


def case_moe_stages(make, root: Path) -> list[Comparison]:
    from roll.parity.cases import get_case
    from tests.parity.test_sweep import MOE_STAGE_CASES, Sweep, moe_stage_comparisons, moe_stage_logs

    cases = [get_case(name) for pair in MOE_STAGE_CASES.values() for name in pair]
    return moe_stage_comparisons(moe_stage_logs(Sweep(make, root, cases)))


def case_rm(make, root: Path) -> list[Comparison]:
    from tests.distributed.test_mca_rm import rm_comparisons, rm_runs

    return rm_comparisons(*rm_runs(make, root))


def case_parity_tool(make, root: Path) -> list[Comparison]:
    from tests.distributed.test_parity_tool import TP2_PADDED, roll_parity, sft_recipe

    recipe = sft_recipe(make("qwen2"), root)
    comparisons = []
    for label, extra, bound in (("roll-parity tp1", (), bounds.PARITY_TOOL_TP1),
                                ("roll-parity tp2 padded", TP2_PADDED, bounds.PARITY_TOOL_TP2)):
        _, result, _ = roll_parity(recipe, "--steps", "3", *extra, timeout=600)
        comparisons.append(Comparison(label, result["losses"]["mca"], result["losses"]["standard"], bound))
    return comparisons


def case_param_groups(make, root: Path) -> list[Comparison]:
    from tests.distributed.test_mca_param_groups import decay_comparison, decay_parity_run

    return [decay_comparison(decay_parity_run(make("qwen2"), root)[1])]


def case_conversion(make, root: Path) -> list[Comparison]:
    from tests.distributed.test_mca_conversion import dense_parity_runs, logit_comparisons, moe_parity_runs

    (root / "dense").mkdir()
    (root / "moe").mkdir()
    return [*logit_comparisons(dense_parity_runs(make, root / "dense")),
            *logit_comparisons(moe_parity_runs(make, root / "moe")[0])]


def case_export(make, root: Path) -> list[Comparison]:
    """The export's logits against the trained model's, as a gap relative to the largest logit."""
    from tests.distributed.test_mca_export import export_runs, overlap_comparison

    result = export_runs(make("qwen2"), root)
    return [overlap_comparison(result),
            *(Comparison(f"export {name}", [1.0 + run["export_vs_trained"] / run["logit_scale"]], [1.0],
                         bounds.EXPORT_LOGITS) for name, run in result.items())]


CASES = {name[len("case_"):]: function for name, function in globals().items() if name.startswith("case_")}


def bound_names() -> dict[int, str]:
    names = {id(value): name for name, value in vars(bounds).items() if isinstance(value, Bound)}
    names.update({id(value): f"LAYOUT[{key!r}]" for key, value in bounds.LAYOUT.items()})
    return names


def summarise(comparisons: list[Comparison]) -> list[dict]:
    """One row per bound: the largest gap over its comparisons and steps, and where."""
    names, rows = bound_names(), {}
    for comparison in comparisons:
        for step, gap in enumerate(comparison.gaps(), start=1):
            bound = comparison.bound
            fresh = {"bound": names[id(bound)], "rel": bound.rel, "recorded": bound.measured, "gap": -1.0,
                     "where": "", "compared": 0}
            row = rows.setdefault(id(bound), fresh)
            row["compared"] += 1
            if gap > row["gap"]:
                row["gap"], row["where"] = gap, f"{comparison.label}, step {step}"
    for row in rows.values():
        row["verdict"] = verdict(row["rel"], row["gap"])
    return list(rows.values())


def verdict(rel: float, gap: float) -> str:
    if gap * 3 > rel:
        return "TOO TIGHT"
    if rel > 100 * max(gap, ONE_ROUNDING):
        return "TOO LOOSE"
    return "ok"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="a case to run (default: all)")
    parser.add_argument("--json", help="also write the rows to this file")
    options = parser.parse_args()
    from roll.logging import setup_logging

    setup_logging("WARNING")
    rows = []
    print(f"{'case':<12} {'bound':<32} {'rel':>8} {'measured':>9} {'ratio':>7} {'n':>4}  verdict    worst at",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="roll-bounds-") as tmp:
        make = model_maker(Path(tmp))
        for name in options.case or list(CASES):
            start = time.monotonic()
            (Path(tmp) / name).mkdir()
            with contextlib.redirect_stdout(sys.stderr):  # the standard backend's own log lines
                comparisons = CASES[name](make, Path(tmp) / name)
            case_rows = [{"case": name, **row} for row in summarise(comparisons)]
            print(f"case {name}: {time.monotonic() - start:.0f} s", file=sys.stderr)
            for row in case_rows:
                ratio = row["rel"] / max(row["gap"], ONE_ROUNDING)
                print(f"{row['case']:<12} {row['bound']:<32} {row['rel']:>8.1e} {row['gap']:>9.1e} "
                      f"{ratio:>7.0f} {row['compared']:>4}  {row['verdict']:<10} {row['where']}", flush=True)
            rows += case_rows
    if options.json:
        with open(options.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
    return 0 if all(row["verdict"] == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
