"""The Megatron loop's pure pieces: sample order, filler rows, LR curves, batch shaping, vocab masking."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from roll import IGNORE_INDEX

pytestmark = pytest.mark.mca
pytest.importorskip("megatron.core")

from backends.mca.trainer.data import BatchPlan, filler_row, model_inputs, pad_to_length  # noqa: E402
from backends.mca.trainer.metrics import report_targets  # noqa: E402
from backends.mca.trainer.optim import (STEP_SCHEDULES, LRSchedule, check_schedule_name, lr_schedules,  # noqa: E402
                                        schedule_for, schedule_name)
from roll.errors import ConfigError  # noqa: E402


def test_batch_plan_docstring_example():
    plan = BatchPlan(micro_batch_size=2, grad_accum=2, dp_size=2, dp_rank=1)
    assert plan.micro_batch_indices(0, 10) == [[2, 3], [6, 7]]
    assert plan.micro_batch_indices(1, 10) == [[None, None], [None, None]]  # samples 8, 9 are rank 0's
    assert plan.micro_batch_indices(2, 10) == [[2, 3], [6, 7]]  # the next epoch
    assert [plan.samples_in_step(k, 10) for k in range(4)] == [8, 2, 8, 2]


def test_batch_plan_covers_every_sample_once_per_epoch():
    """All ranks together read each sample exactly once per epoch, in the shared order."""
    num_samples, steps = 23, 3
    seen = []
    for step in range(steps):
        for rank in range(2):
            plan = BatchPlan(micro_batch_size=2, grad_accum=3, dp_size=2, dp_rank=rank)
            seen += [i for micro in plan.micro_batch_indices(step, num_samples) for i in micro if i is not None]
    assert BatchPlan(2, 3, 2).steps_per_epoch(num_samples) == 2
    assert sorted(seen) == sorted(list(range(num_samples)) + list(range(12)))  # epoch 2 starts over
    plan = BatchPlan(2, 3, 2)
    assert [plan.samples_in_step(k, num_samples) for k in range(3)] == [12, 11, 12]
    assert plan.total_steps(-1, 2.0, num_samples) == 4 and plan.total_steps(7, 2.0, num_samples) == 7


def test_filler_row_docstring_example_and_pairs():
    assert filler_row({"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7]}, 0) == {
        "input_ids": [0, 0], "attention_mask": [0, 0], "labels": [-100, -100]}
    packed = filler_row({"input_ids": [5], "labels": [5], "position_ids": [0], "seq_lens": [1]}, 9)
    assert packed == {"input_ids": [9, 9], "labels": [-100, -100], "position_ids": [0, 1], "seq_lens": [2]}
    pair = filler_row({"chosen_labels": [1], "rejected_input_ids": [2]}, 0)
    assert pair == {"chosen_labels": [-100, -100], "rejected_input_ids": [0, 0]}


SCHEDULE_KWARGS = {"cosine_with_min_lr": {"min_lr_rate": 0.1}, "cosine_warmup_with_min_lr": {"min_lr": 0.01},
                   "warmup_stable_decay": {"num_decay_steps": 4, "min_lr_ratio": 0.1},
                   "polynomial": {"power": 2.0, "lr_end": 1e-3}, "cosine_with_restarts": {"num_cycles": 2}}


@pytest.mark.parametrize("name", lr_schedules())
@pytest.mark.parametrize("warmup", [0, 3, 0.25])
def test_lr_schedule_equals_transformers(name, warmup):
    """Both backends apply the same learning rate at every step (HF's schedule, stepped as HF Trainer)."""
    from transformers import get_scheduler

    total, base = 12, 0.1
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    warmup_steps = warmup if warmup >= 1 else int(-(-total * warmup // 1))
    hf = get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total,
                       scheduler_specific_kwargs=SCHEDULE_KWARGS.get(name))
    ours = LRSchedule(base, name, total, warmup, SCHEDULE_KWARGS.get(name))
    for step in range(total):
        assert ours.lr(step) == pytest.approx(hf.get_last_lr()[0], abs=1e-12), (name, warmup, step)
        optimizer.step()
        hf.step()


def test_every_step_based_hf_schedule_is_offered():
    assert {"linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
            "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay"} <= set(
        lr_schedules())


def test_the_written_out_schedule_list_is_the_installed_transformers_one():
    """Config checks read STEP_SCHEDULES (no torch import); it must name exactly what HF offers."""
    assert set(STEP_SCHEDULES) == set(lr_schedules())
    for name in ("exponential", "reduce_lr_on_plateau"):
        with pytest.raises(ConfigError, match=f"lr_scheduler_type '{name}'"):
            check_schedule_name(name)
    assert check_schedule_name("cosine_with_min_lr") == "cosine_with_min_lr"


def test_unknown_or_metric_driven_lr_schedules_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match="lr_scheduler_type 'exponential'.*constant, .*warmup_stable_decay"):
        schedule_name("exponential")
    with pytest.raises(ConfigError, match="lr_scheduler_type 'reduce_lr_on_plateau'.*eval metric"):
        schedule_name("reduce_lr_on_plateau")
    training = SimpleNamespace(learning_rate=0.1, lr_scheduler_type="cosine_with_min_lr", warmup_steps=0,
                               lr_scheduler_kwargs={})
    with pytest.raises(ConfigError, match="lr_scheduler_kwargs.*min_lr"):  # HF needs min_lr or min_lr_rate
        schedule_for(training, 10)
    training.lr_scheduler_kwargs = '{"min_lr_rate": 0.5}'  # a JSON string, as HF accepts
    assert schedule_for(training, 10).lr(10) == pytest.approx(0.05)


def test_warmup_ratio_is_warmup_steps_below_one():
    from roll.config.training import TrainingArguments

    assert TrainingArguments(warmup_ratio=0.1).warmup_steps == 0.1
    assert LRSchedule(1.0, "linear", 30, 0.1).warmup_steps == 3  # ceil(30 * 0.1), as LLaMA-Factory / HF 4
    with pytest.raises(ConfigError, match="warmup_ratio .* and warmup_steps .* are both set"):
        TrainingArguments(warmup_ratio=0.1, warmup_steps=5)
    with pytest.raises(ConfigError, match="warmup_ratio must be in"):
        TrainingArguments(warmup_ratio=1.5)


def test_pad_to_length_rebuilds_packed_boundaries():
    from roll.data.collators import cu_seqlens_from_positions

    batch = {"input_ids": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([[-100, 6, 7]]),
             "position_ids": torch.tensor([[0, 1, 0]])}
    batch["cu_seqlens"] = cu_seqlens_from_positions(batch["position_ids"])
    out = pad_to_length(batch, 5, pad_token_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 7, 0, 0]]
    assert out["labels"].tolist() == [[-100, 6, 7, IGNORE_INDEX, IGNORE_INDEX]]
    assert out["position_ids"].tolist() == [[0, 1, 0, 0, 1]]
    assert out["cu_seqlens"].tolist() == [0, 2, 3, 5]  # the padding tail is a segment of its own


def test_model_inputs_thd_and_context_parallel_slices():
    batch = {"input_ids": torch.arange(16).reshape(2, 8), "labels": torch.arange(16).reshape(2, 8),
             "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2)}
    batch["cu_seqlens"] = torch.tensor([0, 4, 8, 12, 16], dtype=torch.int32)
    packed = model_inputs(batch, torch.device("cpu"))
    assert packed["input_ids"].shape == (1, 16) and packed["attention_mask"] is None
    assert packed["packed_seq_params"].qkv_format == "thd"
    assert packed["packed_seq_params"].cu_seqlens_q.tolist() == [0, 4, 8, 12, 16]
    cp = model_inputs(batch, torch.device("cpu"), cp_size=2, cp_rank=1)  # chunks 1 and 2 of every sample
    assert cp["input_ids"].tolist() == [[1, 2, 5, 6, 9, 10, 13, 14]]
    plain = model_inputs({"input_ids": torch.arange(8).reshape(1, 8), "labels": torch.zeros(1, 8)},
                         torch.device("cpu"), cp_size=2, cp_rank=0)
    assert plain["input_ids"].tolist() == [[0, 1, 6, 7]] and plain["packed_seq_params"] is None
    assert plain["padding_mask"] is None  # no attention_mask: every token counts in the MoE balancing loss
    padded = {"input_ids": torch.arange(8).reshape(1, 8), "labels": torch.zeros(1, 8),
              "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])}
    cp = model_inputs(padded, torch.device("cpu"), cp_size=2, cp_rank=0, moe=True)
    assert cp["padding_mask"].tolist() == [[False, False, True, True]]  # true at padding, sliced like the tokens
    assert model_inputs(padded, torch.device("cpu"))["padding_mask"] is None  # a dense model reads no mask
    padded["attention_mask"][:] = 0  # a filler micro-batch: no mask, Megatron's loss would divide by 0
    assert model_inputs(padded, torch.device("cpu"), moe=True)["padding_mask"] is None


def _adam_steps(base: torch.optim.Optimizer, grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    for step_grads in grads:
        for param, grad in zip(base.param_groups[0]["params"], step_grads):
            param.grad = grad.clone()
        base.step()
    return [p.detach().clone() for p in base.param_groups[0]["params"]]


def test_megatrons_torch_adam_runs_fused_with_the_same_update():
    """Without TE/Apex the inner optimizer is torch's AdamW (as Megatron builds it, default flags); after
    ``use_fast_adam`` it is the fused kernel on CPU, a shared ``step`` (a loaded checkpoint's) is one per
    parameter, and three updates agree with torch's per-parameter loop (rounding only)."""
    from backends.mca.trainer.optim import use_fast_adam

    torch.manual_seed(0)
    start = [torch.randn(33, 7), torch.randn(7), torch.randn(5, 3, 2)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(3)]

    def adam():
        return torch.optim.AdamW([torch.nn.Parameter(p.clone()) for p in start], lr=1e-2, weight_decay=0.1,
                                 betas=(0.9, 0.95), eps=1e-8)

    reference, fast = adam(), adam()
    assert reference.defaults["fused"] is None and reference.defaults["foreach"] is None  # the slow loop on CPU
    _adam_steps(fast, grads[:1])
    shared = torch.tensor(1.0)
    for state in fast.state.values():
        state["step"] = shared  # what megatron-core's DistributedOptimizer.load_state_dict hands torch
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=fast)])
    assert use_fast_adam(chained) == ["torch_fused"]
    assert fast.defaults["fused"] is True and fast.defaults["foreach"] is False
    assert all(group["fused"] is True and group["foreach"] is False for group in fast.param_groups)
    steps = [state["step"] for state in fast.state.values()]
    assert len({id(step) for step in steps}) == len(steps)
    after = _adam_steps(fast, grads[1:])
    expected = _adam_steps(reference, grads)
    assert [state["step"].item() for state in fast.state.values()] == [3.0] * 3
    for got, want in zip(after, expected):
        # measured 0.0 with torch 2.13's CPU kernels (same operation order); 1e-6 leaves room for a kernel
        # that reassociates (a few float32 ulps of these ~1-sized weights), far below one lr-1e-2 update
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    other = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=torch.optim.SGD(
        [torch.nn.Parameter(torch.zeros(2))], lr=0.1))])
    assert use_fast_adam(other) == ["SGD"]  # not an Adam: left as built (TE / Apex FusedAdam, hybrid offload)


def test_report_to_names():
    assert report_targets("none") == set() and report_targets(None) == set()
    assert report_targets(["tensorboard", "none"]) == {"tensorboard"} and report_targets("all") == {"tensorboard"}


def test_resuming_from_a_standard_backend_checkpoint_is_refused(tmp_path):
    """HF Trainer checkpoints also hold a trainer_state.json; only a Megatron run's checkpoint resumes."""
    from backends.mca.trainer.checkpointing import TrainerState, load

    (tmp_path / "trainer_state.json").write_text('{"global_step": 3, "log_history": []}')
    with pytest.raises(ConfigError, match="not a checkpoint of a Megatron"):
        load(str(tmp_path), [], None, TrainerState())


@pytest.mark.parametrize("keys, expected", [
    (dict(eval_strategy="steps", eval_steps=2), [2, 4, 5]),  # and the last step, as HF's DefaultFlowCallback
    (dict(eval_strategy="steps", eval_steps=0.4), [2, 4, 5]),  # a ratio of the run: ceil(5 * 0.4) steps
    (dict(eval_strategy="steps", eval_steps=None, logging_steps=3), [3, 5]),  # HF's default: logging_steps
    (dict(eval_strategy="steps", eval_steps=2, eval_delay=3), [4, 5]),
    (dict(eval_strategy="epoch"), [2, 4, 5]),  # 16 samples, 8 a step: an epoch is 2 steps
    (dict(eval_strategy="epoch", eval_delay=1.5), [4, 5]),  # in epochs with the epoch strategy
    (dict(eval_strategy="no", eval_steps=1), []),
])
def test_mid_run_eval_steps_follow_hf_trainer(keys, expected):
    from backends.mca.trainer.loop import MegatronTrainer

    trainer = object.__new__(MegatronTrainer)  # only the schedule's pieces: no model
    trainer.training = SimpleNamespace(**{"logging_steps": 1, "eval_steps": None, "eval_delay": 0, **keys})
    trainer.plan = BatchPlan(micro_batch_size=4, grad_accum=2, dp_size=1, dp_rank=0)
    assert [step for step in range(1, 6) if trainer._should_evaluate(step, 5, 16)] == expected


@pytest.mark.parametrize("device, dist_backend, overlap", [("cpu", "gloo", False), ("cuda", "nccl", True)])
def test_ddp_config_from_the_recipe_keys(monkeypatch, device, dist_backend, overlap):
    """Megatron's DDP gets the recipe's grad_reduce_in_fp32 and overlap_grad_reduce; an unset overlap is on
    with GPUs (NCCL) and off on CPU (gloo), measured in docs/performance.md."""
    from backends.mca.trainer import optim
    from roll import platform
    from roll.config import MegatronArguments

    monkeypatch.setattr(platform, "current_platform", lambda: platform.Platform(device, dist_backend))
    default = optim.ddp_config(MegatronArguments())
    assert (default.overlap_grad_reduce, default.grad_reduce_in_fp32, default.average_in_collective) == (
        overlap, True, False)
    for value in (True, False):
        chosen = optim.ddp_config(MegatronArguments(overlap_grad_reduce=value, grad_reduce_in_fp32=False))
        assert (chosen.overlap_grad_reduce, chosen.grad_reduce_in_fp32) == (value, False)


class _Megatron:
    """The surface of megatron-core's (chained) optimizer the update uses, over one torch AdamW."""

    def __init__(self, base: torch.optim.Optimizer, clip_grad: float) -> None:
        params = [p for group in base.param_groups for p in group["params"]]
        self.chained_optimizers = [SimpleNamespace(optimizer=base, config=SimpleNamespace(clip_grad=clip_grad),
                                                   get_parameters=lambda: params)]

    def step_with_ready_grads(self) -> bool:
        self.chained_optimizers[0].optimizer.step()
        return True


HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")


def test_a_step_clips_and_skips_on_the_device_as_megatron_does_on_the_host(monkeypatch):
    """``clip_and_step_on_device`` (the mca loop's update with torch's fused Adam) against megatron-core's rule
    written out by hand (``clip_grad_by_total_norm_fp32``: a Python float coefficient, applied only below 1)
    and torch's AdamW: the same weights to the bit when it clips and when it does not; a non-finite loss or
    gradient norm leaves weights, moments and the step count as they were (a later step equals a run that
    never had the bad one); no tensor is read to the host."""
    from backends.mca.trainer.update import clip_and_step_on_device, skips_on_device

    torch.manual_seed(0)
    start = [torch.randn(33, 7), torch.randn(7)]

    def adam(fused):
        return torch.optim.AdamW([torch.nn.Parameter(p.clone()) for p in start], lr=1e-2, weight_decay=0.1,
                                 fused=fused)

    def by_hand(base, grads, max_norm):  # megatron-core's host-side clip, then the update
        square = float(torch.stack([torch.linalg.vector_norm(g) for g in grads]).norm() ** 2)
        coeff = max_norm / (square ** 0.5 + 1.0e-6)
        for param, grad in zip(base.param_groups[0]["params"], grads):
            param.grad = grad.clone()
            if coeff < 1.0:
                param.grad.mul_(coeff)
        base.step()

    def on_device(opt, grads, loss_sum=0.5):
        for param, grad in zip(opt.chained_optimizers[0].optimizer.param_groups[0]["params"], grads):
            param.grad = grad.clone()
        square = (torch.stack([torch.linalg.vector_norm(g) for g in grads]).norm() ** 2).double()
        return clip_and_step_on_device(opt, torch.tensor(loss_sum, dtype=torch.float64), square)

    reads = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: (reads.append(_n),
                                                                                             _o(self, *a, **k))[1])
    steps = [[torch.randn_like(p) * scale for p in start] for scale in (10.0, 0.01, 3.0)]
    bad = [[g.clone() for g in steps[0]], [g.clone() for g in steps[0]]]
    bad[1][1][3] = float("nan")
    for max_norm in (1.0, 0.0):  # 0: clipping off
        reference, device = adam(fused=True), _Megatron(adam(fused=True), max_norm)
        assert skips_on_device(device) and not skips_on_device(_Megatron(adam(fused=False), max_norm))
        base = device.chained_optimizers[0].optimizer
        for index, grads in enumerate(steps):
            if index == 1:  # a non-finite loss, then a NaN gradient: two skipped steps in between
                before = {k: v.clone() for k, v in base.state[base.param_groups[0]["params"][0]].items()}
                weights = [p.detach().clone() for p in base.param_groups[0]["params"]]
                flags = [on_device(device, bad[0], loss_sum=float("inf")), on_device(device, bad[1])]
                assert [float(f) for f in flags] == [1.0, 1.0]
                after = base.state[base.param_groups[0]["params"][0]]
                assert all(torch.equal(before[k], after[k]) for k in before)  # moments and step count
                assert all(torch.equal(w, p) for w, p in zip(weights, base.param_groups[0]["params"]))
            reads.clear()
            flag = on_device(device, grads)
            assert reads == [], reads
            by_hand(reference, grads, max_norm if max_norm > 0 else float("inf"))
            assert float(flag) == 0.0 and not hasattr(base, "found_inf")
            for got, want in zip(base.param_groups[0]["params"], reference.param_groups[0]["params"]):
                assert torch.equal(got, want), (max_norm, index, (got - want).abs().max())


def test_a_step_the_fp16_grad_scaler_rejects_is_skipped_counted_and_logs_no_norm(monkeypatch):
    """fp16's grad scaler found inf/nan (megatron-core's ``prepare_grads`` returns True; fp16 itself needs a
    GPU, so its verdict is given here): the loop makes no update, and once its numbers are read the step is
    skipped and counted, its loss logged, no grad norm (none was computed)."""
    from backends.mca.trainer import loop
    from backends.mca.trainer.step import LanguageModelObjective
    from backends.mca.trainer.update import PendingStep
    from roll.reliability import SkipCounter

    monkeypatch.setattr(loop.dist, "all_reduce", lambda tensor, *args, **kwargs: None)  # one rank
    calls = []
    optimizer = SimpleNamespace(prepare_grads=lambda: True, step_with_ready_grads=lambda: calls.append("step"))
    sums = torch.tensor([5.0, 2.0, 2.0], dtype=torch.float64)  # loss sum, tokens of the loss, real tokens
    numbers = loop.MegatronTrainer._update(SimpleNamespace(optimizer=optimizer, device=torch.device("cpu")), sums)
    assert calls == []  # no update
    trainer = SimpleNamespace(_pending=[PendingStep(1, 1e-3, numbers)], _train_dataset=[0] * 4, _window=[],
                              objective=LanguageModelObjective(10), state=SimpleNamespace(skipped_steps=0),
                              _speed=SimpleNamespace(add=lambda tokens, rows: None), _rows_in_step=lambda s, n: 2,
                              skips=SkipCounter(0), plan=SimpleNamespace(step_rows=lambda s, n: [0, 1]))
    loop.MegatronTrainer._settle(trainer)
    (stats,) = trainer._window
    assert stats.skipped and stats.grad_norm is None and stats.loss == 2.5 and stats.real_tokens == 2
    assert trainer.state.skipped_steps == 1 and trainer.skips.total == 1 and trainer._pending == []
