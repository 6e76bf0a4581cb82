"""The parity sweep: every case of ``roll.parity.cases`` trained on both backends and compared within its
bounds (loss at step 1 and at every step, the logged learning rate, eval_loss, the exported weights).

CI cost is the design constraint. All the runs of the sweep take three process launches: the standard runs
in one plain process (one per distinct key set: the standard run does not depend on the mca layout, so the
layout cases reuse the 1-process cases' reference), the 1-process mca runs in one ``torchrun`` job, started
beside it (one core each), and the 2-process mca runs in a second ``torchrun`` job, started as soon as one of
the first two ends: the standard runs take about twice as long as the 1-process mca runs (a full sweep on 2
busy cores: 124 s against 51 s of runs), and waiting for both left a core idle for 70 of the sweep's 188 s
(estimated: 150 s when the 2-process job fills it). Interpreter start-up and imports are paid three times, not once per run. ``roll-parity --case NAME`` runs any one case from the
command line; ``pytest 'tests/parity/test_sweep.py::test_case[NAME]'`` trains only that case (the mutation
gate's way).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from roll.launch import free_port
from roll.parity.cases import CASES, LAYOUTS, MODELS, Case
from roll.parity.report import read_log
from tests.helpers import REPO, clean_env

pytestmark = [pytest.mark.distributed, pytest.mark.mca]
WORKER = os.path.join(REPO, "tests", "parity", "_worker.py")
TIMEOUT = 900
"""Per launch (the sweep took 149 s for 67 runs on a busy 2-core machine)."""

XFAIL: dict[str, str] = {}
"""Case name -> why it fails today (a known parity gap, with its measured size); held strictly."""


def _start(runs: list, out_dir, name: str, processes: int) -> tuple[subprocess.Popen, str, str]:
    spec, result, log = (str(out_dir / f"{name}.{ext}") for ext in ("spec.json", "result.json", "log"))
    with open(spec, "w", encoding="utf-8") as fh:
        json.dump({"runs": [{"label": label, "args": run.args} for label, run in runs]}, fh)
    cmd = [sys.executable, WORKER, spec, result]
    if processes:
        cmd[1:1] = ["-m", "torch.distributed.run", f"--nproc_per_node={processes}", "--master_addr=127.0.0.1",
                    f"--master_port={free_port()}"]
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=fh, stderr=subprocess.STDOUT)
    return proc, result, log


def _finish(started: tuple[subprocess.Popen, str, str], deadline: float) -> dict:
    proc, result, log = started
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.returncode != 0 or not os.path.isfile(result):
        with open(log, encoding="utf-8", errors="replace") as fh:
            pytest.fail(f"parity worker exited {proc.returncode}:\n{fh.read()[-6000:]}")
    with open(result, encoding="utf-8") as fh:
        return json.load(fh)


def _model_dir(factory, name: str) -> str:
    keys = dict(MODELS[name])
    return factory(keys.pop("kind"), **keys)


class Sweep:
    """Every case planned and trained; ``verdicts(case)`` compares its runs."""

    def __init__(self, factory, root, cases: list[Case]) -> None:
        from roll.parity.sweep import plan_case

        self.pairs, self.outcome = {}, {}
        standard, mca = [], {1: [], 2: []}
        references: dict[str, tuple[str, list]] = {}
        for case in cases:
            pairs = plan_case(case, str(root / case.name), _model_dir(factory, case.model))
            if case.standard_key in references:  # the same standard run: train it once
                owner, reference = references[case.standard_key]
                pairs = [replace(p, standard=ref.standard) for p, ref in zip(pairs, reference)]
            else:
                owner = case.name
                references[case.standard_key] = owner, pairs
                standard += [(f"{owner}/{p.standard.label}", p.standard) for p in pairs]
            mca[LAYOUTS[case.layout].processes] += [(f"{case.name}/{p.mca.label}", p.mca) for p in pairs]
            self.pairs[case.name] = [(p, f"{owner}/{p.standard.label}", f"{case.name}/{p.mca.label}")
                                     for p in pairs]
        start = time.monotonic()
        deadline = start + TIMEOUT
        first = [_start(runs, root, name, processes) for runs, name, processes in
                 ((standard, "standard", 0), (mca[1], "mca_1p", 1)) if runs]  # a selection may need no launch
        while first and all(proc.poll() is None for proc, *_ in first) and time.monotonic() < deadline:
            time.sleep(0.2)  # until one of them ends: its core is the 2-process job's first
        second = _start(mca[2], root, "mca_2p", 2) if mca[2] else None
        second_deadline = time.monotonic() + TIMEOUT
        for started in first:
            self.outcome.update(_finish(started, deadline))
        if second is not None:
            self.outcome.update(_finish(second, second_deadline))
        self.seconds = time.monotonic() - start
        self.runs = len(standard) + len(mca[1]) + len(mca[2])

    def verdicts(self, case: Case) -> list:
        from roll.parity.sweep import check_case

        out = []
        for pair, *labels in self.pairs[case.name]:
            for label in labels:
                if not self.outcome[label]["ok"]:
                    pytest.fail(f"{case.name}: the {label} run failed:\n{self.outcome[label]['error']}")
            out.append(check_case(case, pair))
        return out


KTO_CASES = ("kto", "tp2_kto", "pp2_vpp2_kto", "kto_weights_lora_eval")
MOE_STAGE_CASES = {"kto": ("kto_moe", "tp2_ep2_kto_moe"), "rm": ("rm_moe", "ep2_rm_moe"),
                   "orpo": ("dpo_orpo_ftx_moe", "ep2_dpo_orpo_ftx_moe"), "simpo": ("dpo_simpo_ftx_moe", "ep2_dpo_simpo_ftx_moe")}
"""Issue 22's stages and losses on the Qwen3-MoE: {stage or loss: (the EP1 case, the EP2 case)}."""
NEEDS = {"test_pref_ftx_adds_the_chosen_responses_nll_on_both_backends": ("cp2_dpo_sigmoid_ftx",),
         "test_the_moe_case_trains_with_the_balancing_loss": ("moe_default_aux_loss",),
         "test_moe_losses_logged_alike_and_ep2_equals_ep1": ("mixtral_moe_losses", "ep2_mixtral_moe_losses"),
         "test_kto_metrics_on_both_backends_and_every_layout": KTO_CASES,
         "test_new_stages_on_moe_ep2_equal_ep1": tuple(name for pair in MOE_STAGE_CASES.values() for name in pair)}
"""The cases each of the other tests reads."""


def _selected_cases(session) -> list[Case]:
    """The cases this session's selected tests of this module need (all of them for the whole module; one for
    ``test_case[NAME]``, as the mutation gate runs it)."""
    names = set()
    for item in session.items:
        if item.module is not sys.modules[__name__]:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        names.update([params["case"].name] if "case" in params else NEEDS.get(item.originalname, ()))
    return [case for case in CASES if case.name in names]


@pytest.fixture(scope="module")
def sweep(request, tiny_model_factory, tmp_path_factory) -> Sweep:
    pytest.importorskip("megatron.core")
    return Sweep(tiny_model_factory, tmp_path_factory.mktemp("parity"), _selected_cases(request.session))


@pytest.mark.parametrize("case", [pytest.param(case, id=case.name, marks=pytest.mark.xfail(
    strict=True, reason=XFAIL[case.name]) if case.name in XFAIL else ()) for case in CASES])
def test_case(sweep, case):
    verdicts = sweep.verdicts(case)
    report = os.environ.get("ROLL_PARITY_REPORT")  # for measuring the bounds: each case's gaps, a JSON line
    if report:
        with open(report, "a", encoding="utf-8") as fh:
            for verdict in verdicts:
                fh.write(json.dumps({"case": case.name, "label": verdict.label, **verdict.gaps(),
                                     "sweep_seconds": round(sweep.seconds), "runs": sweep.runs}) + "\n")
    for verdict in verdicts:
        assert verdict.passed, verdict.summary()
    if case.resume_at is not None:  # each backend's resumed run repeats its own uninterrupted run
        full, resumed = (pair for pair, *_ in sweep.pairs[case.name])
        for backend in ("standard", "mca"):
            before, after = (read_log(getattr(pair, backend).output_dir) for pair in (full, resumed))
            assert after == {step: before[step] for step in resumed.steps}, (backend, before, after)


def _records(output_dir: str) -> dict[int, dict]:
    with open(os.path.join(output_dir, "train_log.jsonl"), encoding="utf-8") as fh:
        return {r["step"]: r for r in map(json.loads, filter(str.strip, fh)) if "loss" in r}


def test_pref_ftx_adds_the_chosen_responses_nll_on_both_backends(sweep):
    """The pref_ftx case's step 1: policy = reference, so each pair's DPO loss is log 2, plus 0.5 x the chosen
    response's mean token NLL, about ln 512 = 6.24 under the untrained 512-token model. Parity alone would
    pass if both backends dropped the term."""
    (pair, *_), = sweep.pairs["cp2_dpo_sigmoid_ftx"]
    for backend in ("standard", "mca"):
        step1 = read_log(getattr(pair, backend).output_dir)[1]
        assert 5.5 < (step1 - math.log(2)) / 0.5 < 7.0, (backend, step1)


def test_the_moe_case_trains_with_the_balancing_loss(sweep):
    """mca logs Megatron's load-balancing loss (about 1 per layer, before its coefficient) at every step of
    the MoE case, and the standard run matches it within the case's bounds: both trained with it."""
    (pair, *_), = sweep.pairs["moe_default_aux_loss"]
    records = _records(pair.mca.output_dir)
    assert sorted(records) == list(pair.steps)
    assert all(0.5 < r.get("moe_aux_loss", 0) < 2 for r in records.values()), records


def test_moe_losses_logged_alike_and_ep2_equals_ep1(sweep):
    """Both backends log ``moe_aux_loss`` and ``moe_z_loss`` (before their coefficients, per layer) beside
    ``loss``, the language-model loss alone, and they agree; mca's EP2 losses equal its EP1 ones within 1e-4
    (issue 21). A balanced router gives an aux loss of 1 per layer; the tiny model's router logits are O(1),
    so the z-loss (logsumexp squared) is about (ln 4)^2 = 1.9."""
    (ep1, *_), = sweep.pairs["mixtral_moe_losses"]
    (ep2, *_), = sweep.pairs["ep2_mixtral_moe_losses"]
    logs = {name: _records(getattr(pair, backend).output_dir) for name, pair, backend in
            (("standard", ep1, "standard"), ("mca", ep1, "mca"), ("mca_ep2", ep2, "mca"))}
    for step in ep1.steps:
        standard, mca, mca_ep2 = (logs[name][step] for name in ("standard", "mca", "mca_ep2"))
        assert abs(mca_ep2["loss"] - mca["loss"]) <= 1e-4 * abs(mca["loss"]), (step, mca_ep2, mca)
        for key in ("moe_aux_loss", "moe_z_loss"):
            assert 0.5 < standard[key] < 4, (step, key, standard)
            assert abs(mca[key] - standard[key]) <= 1e-5 * standard[key], (step, key, mca, standard)
            assert abs(mca_ep2[key] - standard[key]) <= 1e-3 * standard[key], (step, key, mca_ep2, standard)
    # ``loss`` is the language-model loss alone: at step 1 the untrained model's near-uniform prediction
    # over 513 tokens, ln 513 = 6.24, where the MoE terms would add 0.1 x 2 layers x ~1 + 0.01 x 2 x ~1.9
    for name in ("standard", "mca"):
        assert abs(logs[name][1]["loss"] - math.log(513)) < 0.05, (name, logs[name][1])


def _first_step_rows(dataset: str, rows: int) -> list[bool]:
    """The kto_tag of the first ``rows`` training rows: the pipeline shuffles the file once with seed 0 (a
    permutation of the row count only: datasets draws it from numpy's generator)."""
    import datasets

    with open(os.path.join(REPO, dataset), encoding="utf-8") as fh:
        tags = [row["kto_tag"] for row in json.load(fh)]
    return datasets.Dataset.from_dict({"kto_tag": tags}).shuffle(seed=0)["kto_tag"][:rows]


KTO_ABSOLUTE = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins")
"""KTO metrics that start at 0 (compared absolutely, as DPO's rewards); loss and log-probs relatively."""


def _eval_records(output_dir: str) -> dict[int, dict]:
    """{step: the eval record's numbers without their eval_ prefix}."""
    with open(os.path.join(output_dir, "train_log.jsonl"), encoding="utf-8") as fh:
        return {r["step"]: {key[len("eval_"):]: value for key, value in r.items() if key.startswith("eval_")}
                for r in map(json.loads, filter(str.strip, fh)) if "eval_loss" in r}


def kto_logs(sweep) -> dict[str, dict[str, dict[int, dict]]]:
    """{case: {backend: {step: record}}} of the KTO cases, and under "eval" the eval case's eval records."""
    logs = {}
    for name in KTO_CASES:
        (pair, *_), = sweep.pairs[name]
        logs[name] = {backend: _records(getattr(pair, backend).output_dir) for backend in ("standard", "mca")}
    (pair, *_), = sweep.pairs[KTO_CASES[-1]]
    logs["eval"] = {backend: _eval_records(getattr(pair, backend).output_dir) for backend in ("standard", "mca")}
    return logs


def kto_comparisons(logs: dict) -> list:
    """Every KTO metric, step by step: mca against the standard backend in each case (BACKEND_KTO*), TP2 and
    PP2 x VPP2 against TP1 (KTO_LAYOUT*); also for scripts/measure_bounds.py."""
    from roll.kto import METRICS
    from tests.bounds import BACKEND_KTO, BACKEND_KTO_REWARDS, KTO_LAYOUT, KTO_LAYOUT_REWARDS, Comparison

    pairs = [(f"{name} mca vs standard", logs[name]["mca"], logs[name]["standard"],
              (BACKEND_KTO, BACKEND_KTO_REWARDS)) for name in (*KTO_CASES, "eval")]
    pairs += [(f"{name} vs TP1", logs[name]["mca"], logs["kto"]["mca"], (KTO_LAYOUT, KTO_LAYOUT_REWARDS))
              for name in ("tp2_kto", "pp2_vpp2_kto")]
    out = []
    for label, log, reference, bounds in pairs:
        for metric in ("loss", *METRICS):
            absolute = metric in KTO_ABSOLUTE
            out.append(Comparison(f"{label} {metric}", [log[step][metric] for step in sorted(log)],
                                  [reference[step][metric] for step in sorted(reference)], bounds[absolute],
                                  scale=1.0 if absolute else 0.0))
    return out


def test_kto_metrics_on_both_backends_and_every_layout(sweep):
    """stage kto (issue 22). Step 1 has a closed form: the policy is the reference, so every reward and the
    reference point are 0 and a row's loss is its weight / 2 (0.5 with both weights 1). Every logged metric
    (loss, kl, rewards/*, logps/*) of the standard backend and mca at every step within the measured backend
    gap (tests/bounds.py), also with class weights and LoRA (reference: the policy without its adapters) and
    its eval metrics at steps 0, 3 and 5; TP2 and PP2 x VPP2 within the measured layout gap of TP1. The loss is
    all the parity cases compare: a reward or a reference point computed wrongly on one backend fails here."""
    from roll.kto import METRICS
    from tests.bounds import assert_within

    logs = kto_logs(sweep)
    tags = _first_step_rows("recipes/demo/data/arithmetic_kto.json", 8)
    weighted = sum(0.8 if tag else 1.25 for tag in tags) / (2 * len(tags))
    for name, loss in (("kto", 0.5), ("kto_weights_lora_eval", weighted)):
        for backend, log in logs[name].items():
            step1 = log[1]
            assert step1["loss"] == pytest.approx(loss, abs=1e-7) and step1["kl"] == 0.0, (name, backend, step1)
            assert all(step1[key] == 0.0 for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"))
    for name in KTO_CASES:
        for backend, log in logs[name].items():  # both classes in every step of this data: every metric logged
            assert sorted(log) == [1, 2, 3, 4, 5] and all({"loss", *METRICS} <= set(r) for r in log.values())
        moved = logs[name]["mca"]  # past step 1 the reference point and the rewards move
        assert max(r["kl"] for r in moved.values()) > 0.1 and moved[5]["rewards/margins"] != 0, (name, moved)
    for backend, evals in logs["eval"].items():  # eval_on_start, eval_steps 3 and the last step, every metric
        assert sorted(evals) == [0, 3, 5] and all({"loss", *METRICS} <= set(r) for r in evals.values()), evals
    assert_within(kto_comparisons(logs))


def moe_stage_logs(sweep) -> dict[str, dict[str, dict[int, dict]]]:
    """{stage: {"standard" | "mca" | "mca_ep2": {step: record}}} of MOE_STAGE_CASES (the EP2 case's standard
    run is the EP1 case's)."""
    logs = {}
    for stage, (ep1, ep2) in MOE_STAGE_CASES.items():
        (pair, *_), = sweep.pairs[ep1]
        (pair_ep2, *_), = sweep.pairs[ep2]
        logs[stage] = {"standard": _records(pair.standard.output_dir), "mca": _records(pair.mca.output_dir),
                       "mca_ep2": _records(pair_ep2.mca.output_dir)}
    return logs


def stage_metrics(stage: str) -> tuple[str, ...]:
    """``loss`` and the metrics both backends log for ``stage`` (kto, rm) or reference-free loss (orpo, simpo)."""
    from roll import kto, preference, reward

    return ("loss", *{"kto": kto.METRICS, "rm": reward.METRICS, **preference.METRICS}[stage])


def _relative(metric: str) -> bool:
    """Compared relatively: the losses and log-prob means; the rest (rewards, margins, accuracies, kl, log-odds:
    0 at step 1 or crossing 0) on the scale of 1, as KTO_ABSOLUTE and the rm / pref tests do."""
    return metric in ("loss", "nll_loss") or metric.startswith("logps/")


def moe_stage_comparisons(logs: dict) -> list:
    """Every metric of each stage on the MoE model, step by step: mca EP1 against the standard backend
    (BACKEND_MOE_STAGES*), mca EP2 against mca EP1 (MOE_EP2_STAGES*); also for scripts/measure_bounds.py."""
    from tests.bounds import (BACKEND_MOE_STAGES, BACKEND_MOE_STAGES_REWARDS, MOE_EP2_STAGES,
                              MOE_EP2_STAGES_REWARDS, Comparison)

    out = []
    for stage, log in logs.items():
        for label, values, reference, bounds in (
                ("mca vs standard", log["mca"], log["standard"], (BACKEND_MOE_STAGES_REWARDS, BACKEND_MOE_STAGES)),
                ("mca EP2 vs EP1", log["mca_ep2"], log["mca"], (MOE_EP2_STAGES_REWARDS, MOE_EP2_STAGES))):
            for metric in stage_metrics(stage):
                relative = _relative(metric)
                out.append(Comparison(f"{stage} {label} {metric}", [values[s][metric] for s in sorted(values)],
                                      [reference[s][metric] for s in sorted(reference)], bounds[relative],
                                      scale=0.0 if relative else 1.0))
    return out


def test_new_stages_on_moe_ep2_equal_ep1(sweep):
    """Issue 22's stages and losses (kto, rm, orpo and simpo with pref_ftx) on a Qwen3-MoE: every logged metric of
    5 steps on mca equals the standard backend's within the measured backend gap, and mca with the experts on 2
    ranks (EP2 x DP2; kto: TP2 x EP2 at DP1) equals EP1 within the measured layout gap (tests/bounds.py
    *_MOE_STAGES*). Step 1 in closed form where the loss has one (kto 0.5 with kl 0; rm ln 2, the zero head),
    and every run trains (its loss moves)."""
    from tests.bounds import assert_within

    logs = moe_stage_logs(sweep)
    for stage, runs in logs.items():
        for run, log in runs.items():
            assert sorted(log) == [1, 2, 3, 4, 5] and all(set(stage_metrics(stage)) <= set(r) for r in log.values()), \
                (stage, run, log)
            assert abs(log[5]["loss"] - log[1]["loss"]) > 1e-4, (stage, run, log)  # rm: 5e-4 at lr 1e-3
            if stage == "kto":
                assert log[1]["loss"] == pytest.approx(0.5, abs=1e-7) and log[1]["kl"] == 0.0, (run, log[1])
            if stage == "rm":
                assert log[1]["loss"] == pytest.approx(math.log(2), abs=1e-7), (run, log[1])
    assert_within(moe_stage_comparisons(logs))
