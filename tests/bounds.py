"""Every parity and golden bound of the loss tests, next to the gap it was set from.

On CPU in fp32 a run repeats bit for bit, and two runs that compute the same thing differently (the two
backends, two parallel layouts) differ only by the order of floating-point sums: ~1e-7 relative per step.
Each bound here is about 10x the largest gap ``scripts/measure_bounds.py`` measured for its case, over
every logged step, so that a real bug (a changed loss, mask, schedule or weight decay moves a loss by 1e-5
or more) cannot hide under it: the weight decay of 0.01 that Megatron applies when the recipe's 0 is not
passed moves the tiny SFT recipe's loss by 4.8e-5 and fails GOLDEN and BACKEND.

A measured gap below ~1e-7 is one fp32 rounding of a loss near 6 (half an ulp: 4e-8 relative), the
resolution of these runs; bounds there are 1e-6, 10x one rounding.

To re-measure (after a change that moves a gap, e.g. another loss arithmetic):
``OMP_NUM_THREADS=1 python scripts/measure_bounds.py`` prints each bound next to its new measurement and
exits 1 when a gap comes within 3x of its bound (too tight: flaky) or a bound is over 100x its gap (too
loose: a bug hides). Write the new measurement here with its date.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bound:
    rel: float
    """Largest relative difference allowed, at every step (for logits: relative to the largest logit)."""
    measured: float
    """Largest relative difference measured over every step of the case (scripts/measure_bounds.py)."""
    date: str
    """When ``measured`` was measured."""
    why: str
    """Where the measured gap comes from, and so why it is not zero."""


@dataclass(frozen=True)
class Comparison:
    """One series of per-step values against its reference, held to ``bound`` at every step."""
    label: str
    values: list[float]
    reference: list[float]
    bound: Bound
    scale: float = 0.0
    """When set, a gap is ``|value - reference| / scale`` instead of relative to the reference: for values
    that cross zero (DPO's rewards, measured on the scale of 1)."""

    def gaps(self) -> list[float]:
        """The relative difference at each step (inf when the step counts differ)."""
        if len(self.values) != len(self.reference):
            return [float("inf")]
        return [abs(a - b) / (self.scale or abs(b)) if self.scale or b else (float("inf") if a != b else 0.0)
                for a, b in zip(self.values, self.reference)]

    def failures(self) -> list[str]:
        if len(self.values) != len(self.reference):
            return [f"{self.label}: {len(self.values)} steps, expected {len(self.reference)}"]
        return [f"{self.label}: step {step} {a!r} vs {b!r} (rel {gap:.2e} > {self.bound.rel:g})"
                for step, (a, b, gap) in enumerate(zip(self.values, self.reference, self.gaps()), start=1)
                if gap > self.bound.rel]


def assert_within(comparisons: list[Comparison]) -> None:
    """Every step of every comparison within its bound; the message lists each step beyond."""
    bad = [line for comparison in comparisons for line in comparison.failures()]
    assert not bad, "beyond the measured bounds (tests/bounds.py):\n  " + "\n  ".join(bad)


DATE = "2026-11-25"
SUMS = "the same arithmetic with floating-point sums in another order"
PREF_DATE = "2026-11-27"

# ---- goldens and the two backends, same layout (1 process), fp32 -------------------------------------------
GOLDEN = Bound(1e-6, 0.0, DATE,
               "a rerun of the same code on the same CPU is bit-identical (measured at 1 and 2 threads); "
               "1e-6 leaves room for another CPU's kernels (sum order, ~1e-7), not for a changed computation")
BACKEND = Bound(3e-6, 3.1e-7, DATE,
                "HF/TRL vs Megatron-Core: another attention, cross entropy and AdamW implementation, " + SUMS)
BACKEND_TP2 = Bound(2e-6, 2.0e-7, DATE,
                    "the backend gap plus TP2's split matmuls and vocab-parallel cross entropy")
BACKEND_LORA = Bound(2e-6, 1.7e-7, DATE, "PEFT's LoRA vs ours, " + SUMS)
BACKEND_DPO = Bound(4e-6, 3.7e-7, DATE, "TRL's DPO vs ours (loss, logps), " + SUMS)
BACKEND_DPO_REWARDS = Bound(2e-5, 1.9e-6, DATE,
                            "TRL's DPO rewards vs ours, absolute: beta x a difference of two sums of ~60 "
                            "nats of log-probs, each rounded in fp32 (4e-6 apart per ulp)")
BACKEND_PREF = Bound(1e-6, 3.6e-8, PREF_DATE, "orpo / simpo (loss, mean log-probs, orpo's NLL and log-odds): the "
                     "standard backend's forward and AdamW vs Megatron's, " + SUMS + "; below one fp32 rounding of the "
                     "loss, so the 1e-6 floor")
BACKEND_PREF_REWARDS = Bound(1e-6, 1.0e-7, PREF_DATE, "orpo / simpo rewards (beta x a mean log-prob), margins and "
                             "log_odds_ratio, absolute")
BACKEND_BF16 = Bound(3e-3, 2.9e-4, DATE,
                     "bf16 weights and activations (8 mantissa bits, 4e-3 per rounding): HF "
                     "autocast vs Megatron's Float16Module with fp32 main weights round at different places")
BACKEND_DECAY = Bound(1e-6, 9.3e-8, DATE,
                      "the backend gap with weight_decay 1.0, learning rate 1e-2 and a cosine "
                      "schedule (larger updates carry the per-step differences further)")
BACKEND_EVAL = Bound(5e-7, 3.6e-8, DATE,
                     "eval_loss, the per-token mean over the eval set: HF's forward vs Megatron's")

# ---- Megatron layouts against TP1 x DP2 (same global batch), fp32 ------------------------------------------
LAYOUT = {
    "gas4_mbs1": Bound(1e-6, 7.1e-8, DATE, "gradients summed over 4 micro-batches instead of 1, " + SUMS),
    "distributed_optimizer": Bound(1e-6, 3.7e-8, DATE, "reduce-scatter + all-gather instead of all-reduce"),
    "tp2": Bound(1e-6, 3.7e-8, DATE,
                 "row-parallel matmuls summed over 2 ranks, vocab-parallel cross entropy"),
    "tp2_sp": Bound(1e-6, 9.6e-8, DATE, "TP2 with the sequence split for norms and dropout"),
    "pp2": Bound(1e-6, 3.4e-8, DATE, "2 pipeline stages, tied embedding gradients summed across them"),
    "pp2_vpp2": Bound(1e-6, 3.6e-8, DATE, "4 virtual stages (interleaved schedule)"),
    "cp2": Bound(1e-6, 7.7e-8, DATE,
                 "ring attention over 2 sequence halves: softmax merged from partial sums"),
    "moe_ep2": Bound(1e-6, 4.7e-8, DATE,
                     "experts on 2 ranks: token all-to-all, expert gradients reduced apart"),
    "overlap": Bound(1e-6, 0.0, DATE, "DP2 with overlap_grad_reduce and overlap_param_gather vs without"),
    "grad_reduce_bf16": Bound(7e-4, 6.8e-5, DATE,
                              "bf16 weights at DP2, gradients summed over the ranks and divided by the token "
                              "count in bf16 (8 mantissa bits) instead of fp32 (grad_reduce_in_fp32: false)"),
    "packed": Bound(1e-6, 7.0e-8, DATE, "THD-packed samples vs the same samples padded, " + SUMS),
    "packed_cp2": Bound(1e-6, 0.0, DATE, "THD packing with CP2 vs unpacked"),
    "eval_micro_batches": Bound(1e-6, 1.4e-8, DATE,
                                "eval_loss in eval micro-batches of 1 vs 4 (sums regrouped)"),
    "resume_pp2": Bound(1e-6, 3.6e-8, DATE, "a TP2 checkpoint resumed at PP2"),
    "resume_dp2": Bound(1e-6, 0.0, DATE, "a TP2 checkpoint resumed at TP1 x DP2"),
    "resume_dp1": Bound(1e-6, 6.6e-9, DATE, "a DP2 checkpoint resumed on 1 process with "
                        "gradient_accumulation_steps 2: the distributed optimizer's (6.6e-9, its gradients "
                        "summed over micro-batches, not ranks), without it (0.0)"),
}
ELASTIC_RESUME = Bound(1e-6, 1.6e-16, DATE, "standard backend, ZeRO-2 / ZeRO-3: a DP2 checkpoint resumed "
                       "on 1 process with gradient_accumulation_steps 2 (and ZeRO-2 back on 2) through "
                       "DeepSpeed's universal checkpoint: the same sums, one fp64 rounding of the logged loss; "
                       "the bound is the 1e-6 floor (a wrong Adam step count moved it 1.3e-5)")
LORA_LAYOUT = Bound(1e-6, 9.6e-8, DATE, "LoRA at TP2, TP2+SP, PP2 and EP2, " + SUMS)
DPO_LAYOUT = Bound(4e-6, 3.7e-7, DATE,
                   "DPO (loss, logps) at TP2, PP2, PP2 x VPP2, CP2, EP2 and the distributed "
                   "optimizer: log-probs summed over ~60 tokens per sequence, " + SUMS)
DPO_LAYOUT_REWARDS = Bound(2e-5, 2.1e-6, DATE,
                           "DPO's rewards across layouts, absolute (see BACKEND_DPO_REWARDS)")
PREF_LAYOUT = Bound(1e-6, 7.7e-9, PREF_DATE, "orpo / simpo at TP2 (padded vocabulary), PP2 x VPP2 and CP2 vs TP1 x "
                    "DP2 (loss, mean log-probs, orpo's NLL and log-odds), " + SUMS)
PREF_LAYOUT_REWARDS = Bound(1e-6, 5.2e-8, PREF_DATE, "orpo / simpo rewards, margins and log_odds_ratio across "
                            "layouts, absolute")
KTO_DATE = "2026-11-27"
BACKEND_KTO = Bound(2e-6, 1.5e-7, KTO_DATE, "KTO, standard vs mca (loss, logps; 5 steps of the parity cases kto, "
                    "tp2_kto, pp2_vpp2_kto, kto_weights_lora_eval): " + SUMS)
BACKEND_KTO_REWARDS = Bound(1.5e-5, 1.3e-6, KTO_DATE,
                            "KTO's kl and rewards, standard vs mca, absolute: beta x differences of log-prob sums "
                            "of ~60 nats (see BACKEND_DPO_REWARDS); kl up to 3.5")
KTO_LAYOUT = Bound(1e-6, 3.8e-8, KTO_DATE, "KTO (loss, logps) at TP2 and PP2 x VPP2 vs TP1 (mca): " + SUMS)
KTO_LAYOUT_REWARDS = Bound(1.5e-5, 1.4e-6, KTO_DATE, "KTO's kl and rewards at TP2 and PP2 x VPP2 vs TP1, absolute "
                           "(see BACKEND_KTO_REWARDS)")

# ---- stage rm (tests/distributed/test_mca_rm.py): loss relative, the rest (0 at step 1) absolute ------------
RM_DATE = "2026-11-27"
BACKEND_RM = Bound(1e-6, 8.2e-8, RM_DATE, "TRL's RewardTrainer on HF's Qwen2ForSequenceClassification vs Megatron's "
                   "score head (loss, eval_loss): another attention and AdamW implementation, " + SUMS)
BACKEND_RM_REWARDS = Bound(2e-5, 1.6e-6, RM_DATE, "accuracy, margin and the chosen / rejected reward means, "
                           "absolute: rewards near 0.5 after steps at lr 5e-3, each rounded in fp32")
RM_LAYOUT = Bound(1e-6, 6.2e-8, RM_DATE, "rm's loss at TP2 + SP, PP2, PP2 x VPP2 and CP2 vs TP1 x DP2, " + SUMS)
RM_LAYOUT_REWARDS = Bound(1e-5, 6.3e-7, RM_DATE, "rm's accuracy, margin and reward means across layouts, absolute")
RM_EXPORT = Bound(3e-6, 2.2e-7, RM_DATE, "the TP2 + SP exports' rewards of 32 held-out rows (transformers' forward, "
                  "pooled by the pad id) vs the trained Megatron model's, relative to the largest reward")

# ---- roll-parity as a user runs it (3 steps) ---------------------------------------------------------------
PARITY_TOOL_TP1 = Bound(1e-6, 4.1e-8, DATE, "the backend gap through roll-parity's logs")
PARITY_TOOL_TP2 = Bound(1e-6, 1.0e-7, DATE, "the backend gap at TP2 with a padded vocabulary")

# ---- HF <-> Megatron logits (roll-convert check, randomized tiny models, logits O(1): absolute) ------------
CONVERT_TP1 = Bound(7e-5, 6.9e-6, DATE,
                    "Megatron's attention, fused QKV and (MoE) expert sums vs transformers' eager forward; "
                    "worst on Qwen2-MoE (the 1e-5 used before sat 1.4x above it)")
CONVERT_PARALLEL = Bound(1.5e-4, 1.4e-5, DATE,
                         "the TP1 gap plus split matmuls (TP), stages (PP) or experts (EP); worst on Llama-3 "
                         "RoPE scaling at TP2 over 64 tokens")

VL_DATE = "2026-11-27"
BACKEND_VL = Bound(1e-6, 9.4e-8, VL_DATE,
                   "Qwen2.5-VL and Qwen3-VL, step 1 of the mca trainer (TP1 x DP2, TP2 + SP, PP2, CP2 (Qwen3-VL's "
                   "9.4e-8, 2026-11-28 s41; Qwen2.5-VL's 6.8e-8), packed at DP2, PP2 (Qwen2.5-VL) and CP2; images of two "
                   "sizes, a text-only micro-batch) vs transformers' loss on the same rows (packed: also vs the "
                   "standard backend's packed loss, 5.5e-8); Qwen2-VL at TP1 x DP2 6.4e-8: the language model's gap "
                   "(the vision tower is HF's own module), " + SUMS)
BACKEND_VL_STEPS = Bound(4e-6, 3.5e-7, VL_DATE,
                         "Qwen2.5-VL and Qwen3-VL, 2 steps of the mca trainer vs transformers' model trained by hand "
                         "with the same AdamW, schedule and clipping (tower trained and frozen; packed runs also vs "
                         "the standard backend's packed batches, 2.4e-7, 2026-11-28 s41): step 1's gap plus the "
                         "update computed from differently summed gradients, " + SUMS)
VL_LAYOUT = Bound(3e-6, 4.4e-7, VL_DATE,
                  "Qwen2.5-VL and Qwen3-VL, 2 steps at TP2 + SP, PP2, CP2 and packed (DP2, PP2 (Qwen2.5-VL), CP2, TP2 + SP (Qwen3-VL)) vs TP1 "
                  "x DP2 with the vision tower trained (loss ~8-14 on random weights, lr 1e-3; 2026-11-27 s40: 3.8e-7 "
                  "at most; Qwen3-VL 2026-11-28 s41: 2.3e-7): " + SUMS)

# ---- the HF export against the trained model ---------------------------------------------------------------
EXPORT_LOGITS = Bound(5e-6, 3.5e-7, DATE,
                      "transformers' eager attention and matmuls vs Megatron's on the same weights (TP2: "
                      "split matmuls); relative to the largest logit")

# ---- issue 22's stages on a Qwen3-MoE (parity cases *_moe; test_sweep.py::test_new_stages_on_moe_ep2_equal_ep1) ---
MOE_DATE = "2026-11-27"
BACKEND_MOE_STAGES = Bound(1.5e-6, 1.4e-7, MOE_DATE, "kto, rm, orpo, simpo+ftx on the Qwen3-MoE, standard vs mca at EP1 "
                           "(loss, logps, orpo's nll): HF's expert loop vs Megatron's, " + SUMS)
BACKEND_MOE_STAGES_REWARDS = Bound(2e-5, 1.7e-6, MOE_DATE, "their rewards, margins, accuracies, kl and log-odds, "
                                   "standard vs mca at EP1, absolute (the largest: simpo's rewards, beta 2 x a mean log-prob)")
MOE_EP2_STAGES = Bound(1e-6, 2.6e-8, MOE_DATE, "the same on mca at EP2 x DP2 (kto: TP2 x EP2, DP1) vs EP1: tokens sent "
                       "to the experts' ranks and back, expert gradients reduced apart, " + SUMS)
MOE_EP2_STAGES_REWARDS = Bound(1e-5, 1.0e-6, MOE_DATE, "their rewards, margins, accuracies, kl and log-odds at EP2 vs "
                               "EP1, absolute (the largest: kto's kl, about 3 at step 5)")
