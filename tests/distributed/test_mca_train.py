"""The Megatron training loop keeps the loss contract: on every layout, against the standard backend,
across a resume. Real runs (roll.router.run or roll-train) on tiny models, CPU, gloo, fp32.

Layouts are compared at the same global batch (8 samples a step): TP1 x DP2 is the reference for
the 2-process layouts; the backend-parity test compares 1-process runs with the standard backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.bounds import BACKEND, BACKEND_BF16, BACKEND_EVAL, BACKEND_LORA, BACKEND_TP2, LAYOUT, LORA_LAYOUT, Comparison, assert_within
from tests.helpers import REPO, clean_env, output_of, roll_train, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.mca]
WORKERS = os.path.join(REPO, "tests", "distributed", "_mca_workers")
SFT = dict(stage="sft", dataset="recipes/demo/data/arithmetic_sft.json", cutoff_len=64, learning_rate=1e-3,
           per_device_train_batch_size=4, max_steps=10, logging_steps=1, save_strategy="no", save_hf_model=False,
           report_to="none", seed=0)


@pytest.fixture(autouse=True)
def _needs_megatron():
    pytest.importorskip("megatron.core")


def train_runs(tmp_path, base: dict, runs: list[dict], nproc: int = 2, timeout: float = 600,
               worker: str = "train_runs.py") -> dict:
    """Run every ``{"name", "overrides"}`` of ``runs`` in one torchrun job of ``worker`` (in _mca_workers/);
    {name: {"losses": ...}}."""
    spec, result = tmp_path / "spec.json", tmp_path / "result.json"
    spec.write_text(json.dumps({"base": base, "runs": runs}))
    proc = torchrun(os.path.join(WORKERS, worker), str(spec), str(result), nproc=nproc, timeout=timeout)
    assert proc.returncode == 0, output_of(proc)
    return json.loads(result.read_text())


def standard_log(tmp_path, base: dict, name: str, **overrides) -> list[dict]:
    """The standard backend (one process) on the same recipe: the training records of its train_log.jsonl."""
    out = tmp_path / name
    recipe = tmp_path / f"{name}.yaml"
    recipe.write_text(json.dumps({**base, **overrides, "output_dir": str(out)}))  # JSON is YAML
    proc = roll_train(str(recipe), timeout=300)
    assert proc.returncode == 0, output_of(proc)
    with open(out / "train_log.jsonl", encoding="utf-8") as fh:
        return [record for record in map(json.loads, fh) if "loss" in record]


class StandardRuns:
    """Standard-backend runs (1 process each) of ``{name: recipe}``, trained one after the other in one process
    (tests/parity/_worker.py: roll-train's own entry point, as the parity sweep runs them), started at once so
    that a 1-process Megatron job can train beside it: one interpreter start-up and import for all of them.
    Each run's output_dir is ROOT/NAME; ``logs()`` waits, then {name: its train_log.jsonl training records}."""

    def __init__(self, root, recipes: dict[str, dict], timeout: float = 600) -> None:
        self.root, self.names, self.timeout = root, list(recipes), timeout
        runs = []
        for name, recipe in recipes.items():
            path = root / f"{name}.yaml"
            path.write_text(json.dumps({**recipe, "output_dir": str(root / name)}))  # JSON is YAML
            runs.append({"label": name, "args": [str(path)]})
        spec, self.result, self.log = (root / f"standard_runs.{ext}" for ext in ("spec.json", "result.json", "log"))
        spec.write_text(json.dumps({"runs": runs}))
        with open(self.log, "w", encoding="utf-8") as fh:
            self.proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "parity", "_worker.py"),
                                          str(spec), str(self.result)], cwd=REPO, env=clean_env(), stdout=fh,
                                         stderr=subprocess.STDOUT)

    def logs(self) -> dict[str, list[dict]]:
        try:
            self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        outcome = json.loads(self.result.read_text()) if self.result.exists() else {}
        failed = {name: outcome.get(name, {}).get("error", "not run") for name in self.names
                  if not outcome.get(name, {}).get("ok")}
        assert self.proc.returncode == 0 and not failed, (failed, self.log.read_text()[-4000:])
        logs = {}
        for name in self.names:
            with open(self.root / name / "train_log.jsonl", encoding="utf-8") as fh:
                logs[name] = [record for record in map(json.loads, fh) if "loss" in record]
        return logs


ODD_EVAL = {"eval_dataset": "recipes/demo/data/arithmetic_sft.json", "per_device_eval_batch_size": 34}
"""An end-of-run eval of 3 micro-batches per rank at DP1 (100 rows)."""


def standard_losses(tmp_path, base: dict, name: str, **overrides) -> list[float]:
    return [record["loss"] for record in standard_log(tmp_path, base, name, **overrides)]


LAYOUTS = ("gas4_mbs1", "distributed_optimizer", "tp2", "tp2_sp", "pp2", "pp2_vpp2", "cp2")


def layout_runs(make_model, root) -> dict:
    """TP1 x DP2 and every other 2-process layout, 10 steps each, in one torchrun job (``make_model`` is
    the ``tiny_model_factory`` fixture or scripts/measure_bounds.py's equivalent)."""
    dense = make_model("qwen2", num_layers=4)  # tied embeddings: PP syncs the shared weight
    moe = make_model("qwen3_moe")
    base = {**SFT, "model_name_or_path": dense, "output_dir": str(root / "out")}
    runs = [
        {"name": "tp1_dp2"},
        {"name": "gas4_mbs1", "overrides": {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 4}},
        {"name": "distributed_optimizer", "overrides": {"use_distributed_optimizer": True}},
        {"name": "tp2", "overrides": {"tensor_model_parallel_size": 2, "gradient_accumulation_steps": 2}},
        {"name": "tp2_sp", "overrides": {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                         "gradient_accumulation_steps": 2}},
        {"name": "pp2", "overrides": {"pipeline_model_parallel_size": 2, "gradient_accumulation_steps": 2,
                                      **ODD_EVAL}},
        {"name": "pp2_vpp2", "overrides": {"pipeline_model_parallel_size": 2, "gradient_accumulation_steps": 2,
                                           "virtual_pipeline_model_parallel_size": 2, **ODD_EVAL}},
        {"name": "cp2", "overrides": {"context_parallel_size": 2, "gradient_accumulation_steps": 2}},
        {"name": "moe_ep1", "overrides": {"model_name_or_path": moe}},
        {"name": "moe_ep2", "overrides": {"model_name_or_path": moe, "expert_model_parallel_size": 2}},
        *GRAD_REDUCE_RUNS,
    ]
    return train_runs(root, base, runs)


GRAD_REDUCE_RUNS = ({"name": "bf16_dp2", "overrides": {"bf16": True}},
                    {"name": "bf16_dp2_reduce_bf16", "overrides": {"bf16": True, "grad_reduce_in_fp32": False}})
"""bf16 weights at DP2, gradients summed over the ranks in fp32 (the default) and in bf16."""


def layout_comparisons(result: dict) -> list[Comparison]:
    """Every layout's losses against TP1 x DP2's (EP2 against EP1 at the same DP), and EP2's aux loss."""
    reference = result["tp1_dp2"]["losses"]
    aux = [[entry["moe_aux_loss"] for entry in result[name]["log"]] for name in ("moe_ep2", "moe_ep1")]
    return [*(Comparison(name, result[name]["losses"], reference, LAYOUT[name]) for name in LAYOUTS),
            Comparison("moe_ep2", result["moe_ep2"]["losses"], result["moe_ep1"]["losses"], LAYOUT["moe_ep2"]),
            Comparison("moe_ep2 aux loss", *aux, LAYOUT["moe_ep2"]),
            Comparison("bf16 DP2, grad_reduce_in_fp32 false vs true", result["bf16_dp2_reduce_bf16"]["losses"],
                       result["bf16_dp2"]["losses"], LAYOUT["grad_reduce_bf16"])]


def test_layouts_give_the_same_losses(tiny_model_factory, tmp_path):
    """10 steps, each within its measured bound (tests/bounds.py) of TP1 x DP2: TP2 (+SP), PP2 (1F1B),
    PP2 x VPP2, CP2, the distributed optimizer, GAS=4 x MBS=1, and EP2 for a MoE model (against EP1 at the
    same DP); PP2 x VPP2's eval micro-batch count obeys the interleaved schedule's rule; bf16 at DP2 with
    gradients reduced in bf16 (grad_reduce_in_fp32: false) against fp32 reduction."""
    result = layout_runs(tiny_model_factory, tmp_path)
    reference = result["tp1_dp2"]["losses"]
    assert len(reference) == 10 and reference[-1] < reference[0] - 0.3, reference  # it learns
    assert_within(layout_comparisons(result))
    # 100 eval rows in micro-batches of 34: 3 micro-batches, which the interleaved schedule refuses; the
    # end-of-run eval runs 4 (the last all filler) and gets 1F1B's eval_loss.
    vpp_eval, pp_eval = result["pp2_vpp2"]["metrics"]["eval_loss"], result["pp2"]["metrics"]["eval_loss"]
    assert abs(vpp_eval - pp_eval) <= LAYOUT["pp2_vpp2"].rel * pp_eval, (vpp_eval, pp_eval)
    assert result["moe_ep2"]["log"][0]["moe_aux_loss"] > 0
    # grad_reduce_in_fp32: false reaches Megatron's DDP: the bf16 sums round, so the losses move (within bound).
    assert result["bf16_dp2_reduce_bf16"]["losses"] != result["bf16_dp2"]["losses"]


def backend_runs(model_dir: str, root) -> dict:
    """The SFT and PT recipes on the standard backend (1 process) and on Megatron at TP1 (1 process), TP2,
    and TP2 with a padded vocabulary (2 processes), and SFT in bf16 at TP1, 10 steps each; {run: losses} with
    the standard backend's as "std_sft", "std_pt", "std_bf16"."""
    sft = {**SFT, "model_name_or_path": model_dir, "output_dir": str(root / "out")}
    pt = {**sft, "stage": "pt", "dataset": "recipes/demo/data/arithmetic_pt.jsonl"}
    standard = StandardRuns(root, {"std_sft": sft, "std_pt": pt, "std_bf16": {**sft, "bf16": True}})
    (root / "one").mkdir()  # beside the standard runs: one core each
    one = train_runs(root / "one", sft, [{"name": "sft_tp1"}, {"name": "bf16_tp1", "overrides": {"bf16": True}}],
                     nproc=1)
    losses = {name: [record["loss"] for record in log] for name, log in standard.logs().items()}
    padded = {"tensor_model_parallel_size": 2, "make_vocab_size_divisible_by": 384}
    two = train_runs(root, sft, [
        {"name": "sft_tp2", "overrides": {"tensor_model_parallel_size": 2}},
        {"name": "sft_tp2_padded", "overrides": padded},
        {"name": "pt_tp2_padded", "overrides": {**padded, "stage": "pt", "dataset": pt["dataset"]}},
    ])
    return {**losses, **{name: run["losses"] for name, run in {**one, **two}.items()}}


def backend_comparisons(losses: dict) -> list[Comparison]:
    bounds = {"sft_tp1": BACKEND, "sft_tp2": BACKEND_TP2, "sft_tp2_padded": BACKEND_TP2, "pt_tp2_padded": BACKEND_TP2,
              "bf16_tp1": BACKEND_BF16}
    return [Comparison(name, losses[name], losses["std_" + name.split("_")[0]], bound)
            for name, bound in bounds.items()]


def test_backend_parity_sft_and_pt(tiny_model_dir, tmp_path):
    """The same recipe on the standard backend and on Megatron, every one of 10 steps within the measured
    backend gap (tests/bounds.py: BACKEND at TP1, BACKEND_TP2, BACKEND_BF16); at TP1, TP2, and TP2 with a
    padded vocabulary (512 tokens padded to 768: the padded logits must not enter the softmax); in bf16 at TP1."""
    assert_within(backend_comparisons(backend_runs(tiny_model_dir, tmp_path)))


def eval_records(output_dir) -> list[dict]:
    with open(os.path.join(output_dir, "train_log.jsonl"), encoding="utf-8") as fh:
        return [record for record in map(json.loads, fh) if "eval_loss" in record]


def eval_runs(model_dir: str, tmp_path) -> tuple[list[dict], list[dict], dict]:
    """The eval recipe on the standard backend and on mca (1 process; also with eval batches of 1 and only
    the end-of-run eval): (standard eval records, mca eval records, the mca runs)."""
    recipe = {**SFT, "model_name_or_path": model_dir, "max_steps": 4, "val_size": 0.1,
              "eval_strategy": "steps", "eval_steps": 2, "eval_on_start": True, "per_device_eval_batch_size": 4}
    standard = tmp_path / "standard.yaml"
    standard.write_text(json.dumps({**recipe, "output_dir": str(tmp_path / "std")}))  # JSON is YAML
    proc = roll_train(str(standard), timeout=300)
    assert proc.returncode == 0, output_of(proc)
    single = {"output_dir": str(tmp_path / "single"), "per_device_eval_batch_size": 1, "eval_strategy": "no",
              "eval_on_start": False}
    mca = train_runs(tmp_path, {**recipe, "output_dir": str(tmp_path / "mca")},
                     [{"name": "mca"}, {"name": "single", "overrides": single}], nproc=1)
    return eval_records(tmp_path / "std"), eval_records(tmp_path / "mca"), mca


def eval_comparisons(reference: list[dict], records: list[dict], mca: dict) -> list[Comparison]:
    return [Comparison("eval_loss mca vs standard", [r["eval_loss"] for r in records],
                       [r["eval_loss"] for r in reference], BACKEND_EVAL),
            Comparison("eval_loss in micro-batches of 1", [mca["single"]["metrics"]["eval_loss"]],
                       [records[-1]["eval_loss"]], LAYOUT["eval_micro_batches"])]


def test_mid_run_eval_at_the_same_steps_with_the_same_eval_loss(tiny_model_dir, tmp_path):
    """eval_strategy steps, eval_steps 2, eval_on_start, 4 steps, 10 eval rows in batches of 4, 4 and 2 (HF's
    own eval_loss is 2e-4 off the per-token mean here): both backends log eval_loss at steps 0, 2 and 4,
    once each (the router's final eval reuses step 4's), within the measured backend gap (BACKEND_EVAL in
    tests/bounds.py). The same run on mca with batches of 1 (two schedule calls: 8 micro-batches, then 2 and
    6 fillers) and only the end-of-run eval: the same final eval_loss within its measured gap."""
    reference, records, mca = eval_runs(tiny_model_dir, tmp_path)
    assert [r["step"] for r in reference] == [r["step"] for r in records] == [0, 2, 4], (reference, records)
    assert_within(eval_comparisons(reference, records, mca))
    assert mca["mca"]["metrics"]["eval_loss"] == records[-1]["eval_loss"]
    assert [r["step"] for r in eval_records(tmp_path / "single")] == [4]


def resume_runs(model_dir: str, tmp_path) -> dict:
    """A TP2 run saving at step 3, resumed from it at TP2, PP2 and TP1 x DP2; the distributed optimizer
    saving at steps 2, 4, 6 and resumed from step 4. One torchrun job."""
    full, dist_opt = tmp_path / "full", tmp_path / "dist_opt"
    base = {**SFT, "model_name_or_path": model_dir, "max_steps": 6, "output_dir": str(full),
            "tensor_model_parallel_size": 2, "gradient_accumulation_steps": 2}
    resume = {"resume_from_checkpoint": str(full / "checkpoint-3")}
    dp2 = {"tensor_model_parallel_size": 1, "gradient_accumulation_steps": 1}
    result = train_runs(tmp_path, base, [
        {"name": "full", "overrides": {"save_strategy": "steps", "save_steps": 3}},
        {"name": "same_layout", "overrides": {**resume, "output_dir": str(tmp_path / "same")}},
        {"name": "pp2", "overrides": {**resume, "output_dir": str(tmp_path / "pp2"), "tensor_model_parallel_size": 1,
                                      "pipeline_model_parallel_size": 2}},
        {"name": "dp2", "overrides": {**resume, **dp2, "output_dir": str(tmp_path / "dp2"),
                                      "save_strategy": "steps", "save_steps": 2}},
        {"name": "dist_opt", "overrides": {**dp2, "use_distributed_optimizer": True, "output_dir": str(dist_opt),
                                           "save_strategy": "steps", "save_steps": 2, "save_total_limit": 2}},
        {"name": "dist_opt_resumed", "overrides": {**dp2, "use_distributed_optimizer": True,
                                                   "output_dir": str(tmp_path / "dist_opt_resumed"),
                                                   "resume_from_checkpoint": str(dist_opt / "checkpoint-4")}},
    ])
    return result


def shrunk_runs(model_dir: str, tmp_path) -> dict:
    """The DP2 checkpoints of ``resume_runs`` (step 4, with and without the distributed optimizer) resumed
    on one process with gradient_accumulation_steps 2: the same global batch of 8 (a requeued job on fewer
    nodes). One torchrun job of one process."""
    base = {**SFT, "model_name_or_path": model_dir, "max_steps": 6, "gradient_accumulation_steps": 2}
    (tmp_path / "dp1").mkdir(exist_ok=True)
    dist_opt, plain = str(tmp_path / "dist_opt" / "checkpoint-4"), str(tmp_path / "dp2" / "checkpoint-4")
    return train_runs(tmp_path / "dp1", base, [
        {"name": "dist_opt_dp1", "overrides": {"use_distributed_optimizer": True,
                                               "resume_from_checkpoint": dist_opt,
                                               "output_dir": str(tmp_path / "dist_opt_dp1")}},
        {"name": "plain_dp1", "overrides": {"resume_from_checkpoint": plain,
                                            "output_dir": str(tmp_path / "plain_dp1")}},
    ], nproc=1)


def resume_comparisons(result: dict, shrunk: dict | None = None) -> list[Comparison]:
    compared = [Comparison(f"resumed at {name}", result[name]["losses"], result["full"]["losses"][3:],
                           LAYOUT[f"resume_{name}"]) for name in ("pp2", "dp2")]
    if shrunk is not None:
        compared += [Comparison("DP2 -> DP1, distributed optimizer", shrunk["dist_opt_dp1"]["losses"],
                                result["dist_opt"]["losses"][4:], LAYOUT["resume_dp1"]),
                     Comparison("DP2 -> DP1", shrunk["plain_dp1"]["losses"], result["dp2"]["losses"][1:],
                                LAYOUT["resume_dp1"])]
    return compared


def test_resume_reproduces_the_uninterrupted_run(tiny_model_dir, tmp_path):
    """A run resumed from its step-3 checkpoint repeats steps 4-6 exactly at the same layout, and within the
    measured layout gap (tests/bounds.py) at another TP / PP / DP layout; the distributed optimizer too
    (resumed from step 4, with save_total_limit keeping the newest two checkpoints)."""
    full, dist_opt = tmp_path / "full", tmp_path / "dist_opt"
    result = resume_runs(tiny_model_dir, tmp_path)
    uninterrupted = result["full"]["losses"]
    assert result["same_layout"]["losses"] == uninterrupted[3:]
    shrunk = shrunk_runs(tiny_model_dir, tmp_path)
    assert_within(resume_comparisons(result, shrunk))
    assert result["dist_opt_resumed"]["losses"] == result["dist_opt"]["losses"][4:]
    assert sorted(os.listdir(full)) == [".roll_run.json", "checkpoint-3", "checkpoint-6", "loss.png",
                                        "train_log.jsonl"]
    assert sorted(p for p in os.listdir(dist_opt) if p.startswith("checkpoint")) == ["checkpoint-4", "checkpoint-6"]
    state = json.loads((full / "checkpoint-3" / "trainer_state.json").read_text())
    assert (state["global_step"], state["consumed_samples"], state["global_batch_size"]) == (3, 24, 8)


@pytest.mark.parametrize("layout", [[], ["context_parallel_size=2"]], ids=["tp1", "cp2"])
def test_packed_equals_unpacked_on_the_same_samples(tiny_model_dir, tmp_path, layout):
    """THD packing (PackedSeqParams, per-sample causal attention and RoPE) trains exactly like the same
    samples unpacked; with context parallelism every packed sample is split into 2 x CP chunks."""
    losses = packed_runs(tiny_model_dir, tmp_path, layout)
    assert len(losses["packed"]) == 5
    assert_within([packed_comparison(losses, layout)])


def packed_runs(model_dir: str, tmp_path, layout: list[str]) -> dict:
    """5 steps packed and the same samples unpacked, at TP1 (1 process) or with ``layout`` (2 processes)."""
    result = tmp_path / "result.json"
    proc = torchrun(os.path.join(WORKERS, "packed_runs.py"), model_dir, str(result), *layout,
                    nproc=2 if layout else 1, timeout=300)
    assert proc.returncode == 0, output_of(proc)
    return json.loads(result.read_text())


def packed_comparison(losses: dict, layout: list[str]) -> Comparison:
    return Comparison(f"packed {' '.join(layout) or 'tp1'}", losses["packed"], losses["unpacked"],
                      LAYOUT["packed_cp2" if layout else "packed"])


def lora_runs(make_model, tmp_path) -> tuple[list[float], dict]:
    """LoRA on the standard backend (1 process) and, in one 2-process torchrun job, at TP1 x DP2 (saving at
    step 5, then resumed from it), TP2, TP2+SP, PP2, MoE EP1 and EP2, and dpo with LoRA."""
    dense = make_model("qwen2", num_layers=4)
    moe = make_model("qwen3_moe")
    lora = {"finetuning_type": "lora", "lora_rank": 8, "lora_target": "all", "learning_rate": 1e-2}
    base = {**SFT, **lora, "model_name_or_path": dense, "output_dir": str(tmp_path / "out")}
    standard = standard_losses(tmp_path, base, "std", per_device_train_batch_size=8)
    ckpt = tmp_path / "ckpt"
    dpo = {"stage": "dpo", "dataset": "recipes/demo/data/arithmetic_dpo.json", "max_steps": 3}
    result = train_runs(tmp_path, base, [
        {"name": "tp1_dp2", "overrides": {"save_strategy": "steps", "save_steps": 5, "output_dir": str(ckpt)}},
        {"name": "resumed", "overrides": {"resume_from_checkpoint": str(ckpt / "checkpoint-5"),
                                          "output_dir": str(tmp_path / "resumed"), "save_hf_model": True}},
        {"name": "tp2", "overrides": {"tensor_model_parallel_size": 2, "gradient_accumulation_steps": 2}},
        {"name": "tp2_sp", "overrides": {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                         "gradient_accumulation_steps": 2}},
        {"name": "pp2", "overrides": {"pipeline_model_parallel_size": 2, "gradient_accumulation_steps": 2}},
        {"name": "moe_ep1", "overrides": {"model_name_or_path": moe}},
        {"name": "moe_ep2", "overrides": {"model_name_or_path": moe, "expert_model_parallel_size": 2}},
        {"name": "dpo", "overrides": dpo},
    ])
    return standard, result


def lora_comparisons(standard: list[float], result: dict) -> list[Comparison]:
    reference = result["tp1_dp2"]["losses"]
    return [Comparison("lora vs standard", reference, standard, BACKEND_LORA),
            *(Comparison(f"lora {name}", result[name]["losses"], reference, LORA_LAYOUT)
              for name in ("tp2", "tp2_sp", "pp2")),
            Comparison("lora moe_ep2", result["moe_ep2"]["losses"], result["moe_ep1"]["losses"], LORA_LAYOUT)]


def test_lora_trajectories_across_layouts_and_backends(tiny_model_factory, tmp_path):
    """LoRA through the whole loop, 10 steps each within its measured bound (tests/bounds.py): TP2, TP2+SP,
    PP2 against TP1 x DP2, MoE EP2 against EP1, and the standard backend's PEFT LoRA (the same initial
    adapter); an adapter-only checkpoint resumes exactly; dpo with LoRA uses the policy without adapters as
    reference (step 1 is ln 2)."""
    standard, result = lora_runs(tiny_model_factory, tmp_path)
    reference = result["tp1_dp2"]["losses"]
    assert reference[-1] < reference[0] - 0.3, reference
    assert_within(lora_comparisons(standard, result))
    assert result["resumed"]["losses"] == reference[5:]
    ckpt = tmp_path / "ckpt"
    assert os.path.isfile(ckpt / "checkpoint-5" / "adapter_config.json")
    written = os.listdir(tmp_path / "resumed")  # the final export is a PEFT adapter, not a model
    assert "adapter_model.safetensors" in written and not any(name.startswith("model") for name in written)
    assert result["dpo"]["losses"][0] == pytest.approx(0.6931471805599453, abs=1e-7)


def test_export_accumulation_and_resume_on_one_process(tiny_model_dir, tmp_path):
    """One process, 3 steps, against the standard backend (micro-batch 4) and itself, in one launch:

    - the HF export equals the standard backend's within 5e-5 (measured: 4.7e-6 largest elementwise gap,
      10x that), while one Adam update moves weights by up to the learning rate (1e-3; 2e-3 over the 3
      steps): an export that misses the last optimizer step, or reads the weights from before it, is caught.
      The losses of such a run are all right (each is computed before its update), so no loss check sees it;
    - GAS=2 x MBS=2 logs the standard backend's losses at every step within tests.bounds.BACKEND (measured
      here: 5.3e-8): the loss is normalised per token of the global batch, not per micro-batch;
    - a run resumed from checkpoint-2 logs step 3's loss exactly: no batch skipped or repeated;
    - only a step that logs reads the device, once (every step's loss reports, grad norm and skip flag since
      the previous log together): on a GPU every other read (``.item()``, ``float()``, ``if tensor``) would
      make the host wait for the device. A run logging every 3rd step reads at step 3 only, and logs the mean
      of the per-step run's 3 losses."""
    from safetensors.torch import load_file

    base = {**SFT, "model_name_or_path": tiny_model_dir, "max_steps": 3, "save_hf_model": True}
    standard = [record["loss"] for record in standard_log(tmp_path, base, "std")]
    full = tmp_path / "mca"
    no_export = {"save_hf_model": False}
    result = train_runs(tmp_path, {**base, "output_dir": str(full)}, [
        {"name": "mca", "overrides": {"save_strategy": "steps", "save_steps": 2}, "count_host_reads": True},
        {"name": "gas2", "overrides": {**no_export, "output_dir": str(tmp_path / "gas2"),
                                       "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}},
        {"name": "resumed", "overrides": {**no_export, "output_dir": str(tmp_path / "resumed"),
                                          "resume_from_checkpoint": str(full / "checkpoint-2")}},
        {"name": "log3", "overrides": {**no_export, "output_dir": str(tmp_path / "log3"), "logging_steps": 3},
         "count_host_reads": True},
    ], nproc=1)
    std = load_file(str(tmp_path / "std" / "model.safetensors"))
    mca = load_file(str(full / "model-00001-of-00001.safetensors"))
    start = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert std.keys() == mca.keys() == start.keys(), (sorted(std), sorted(mca))
    moved = max((std[key] - start[key]).abs().max().item() for key in std)
    worst = max((std[key] - mca[key]).abs().max().item() for key in std)
    assert moved > 1e-3 and worst <= 5e-5, (moved, worst)
    assert_within([Comparison("gas2 vs standard", result["gas2"]["losses"], standard, BACKEND)])
    assert result["resumed"]["losses"] == result["mca"]["losses"][2:], (result["resumed"], result["mca"])
    assert result["mca"]["host_reads"] == [1, 1, 1], result["mca"]["host_reads"]
    assert result["log3"]["host_reads"] == [0, 0, 1], result["log3"]["host_reads"]
    assert result["log3"]["losses"] == [sum(result["mca"]["losses"]) / 3], result["log3"]  # the same updates
