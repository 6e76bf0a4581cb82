"""roll.loss: one loss arithmetic, accurate on peaked logits, and the one both backends call."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from roll import IGNORE_INDEX
from roll import loss as roll_loss

PEAKED_BOUND = 5e-8
"""Relative error of a float32 token-loss sum on ``peaked_batch`` against float64. Measured (seeds 0-3):
roll.loss 2.3e-9 .. 1.2e-8; plain float32 ``F.cross_entropy`` 3.0e-7 .. 4.7e-7 (it rounds ``max + log(sum)``
near the logits' magnitude, about 30 here: trained models have logits that large)."""


def peaked_batch(rows: int = 64, vocab: int = 49152, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits like a trained model's: about 30 in magnitude, the label 12 above the crowd (loss ~1.5)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 2 + 30
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    logits[torch.arange(rows), labels] += 12
    return logits, labels


def test_peaked_logits_within_the_bound_where_plain_float32_cross_entropy_is_not():
    logits, labels = peaked_batch()
    reference = F.cross_entropy(logits.double(), labels, reduction="sum").item()
    log_probs, mask = roll_loss.token_log_probs(logits, labels)
    assert mask.all() and log_probs.dtype == torch.float32
    assert abs(roll_loss.loss_sum(log_probs).item() / reference - 1) < PEAKED_BOUND
    # What the standard backend computed before roll.loss (a Hugging Face model's own loss): beyond the bound.
    plain = F.cross_entropy(logits, labels, reduction="sum").item()
    assert abs(plain / reference - 1) > PEAKED_BOUND


def test_ignored_labels_are_zero_and_unmasked_ones_match_log_softmax():
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]]])
    labels = torch.tensor([[1, IGNORE_INDEX]])
    log_probs, mask = roll_loss.token_log_probs(logits, labels)
    assert mask.tolist() == [[True, False]] and log_probs[0, 1].item() == 0.0
    assert log_probs[0, 0].item() == pytest.approx(torch.log_softmax(logits[0, 0].double(), -1)[1].item(), rel=1e-7)
    # the causal form shifts once: position t's logits predict label t + 1
    loss_sum, tokens = roll_loss.causal_lm_loss_sum(logits, torch.tensor([[IGNORE_INDEX, 2]]))
    assert tokens.item() == 1 and loss_sum.dtype == torch.float64
    assert loss_sum.item() == pytest.approx(-torch.log_softmax(logits[0, 0].double(), -1)[2].item(), rel=1e-7)


def test_sums_are_float64_and_do_not_lose_small_terms():
    # 2**24 + 1 is not a float32: a float32 accumulation drops the ones next to a large term.
    log_probs = torch.tensor([[-(2.0**24)] + [-1.0] * 64])
    assert roll_loss.loss_sum(log_probs).item() == 2.0**24 + 64
    assert roll_loss.sequence_sums(log_probs).tolist() == [-(2.0**24) - 64]


def _tp1(monkeypatch):
    """megatron.core's parallel state as one process at TP1 / CP1 sees it, without initialising it."""
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state as ps

    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(ps, "get_context_parallel_world_size", lambda: 1)


def test_both_backends_give_bit_identical_sft_losses(monkeypatch):
    """The standard backend's training and eval loss and the mca backend's (TP1, its vocabulary padded) on the
    same peaked logits: equal to the last bit, because both are roll.loss (any other arithmetic on one side
    differs by ~1e-7; the padding in the softmax, by far more)."""
    from backends.mca.trainer import loss as mca_loss
    from backends.standard.trainers import TokenMeanLossMixin, token_loss_rows

    _tp1(monkeypatch)
    logits, labels = peaked_batch(rows=48)
    logits, labels = logits.view(2, 24, -1), labels.view(2, 24)
    labels[0, :5] = IGNORE_INDEX  # a masked prompt
    hf_labels = torch.cat([torch.full((2, 1), IGNORE_INDEX), labels], dim=1)  # HF-aligned: shifted by the loss
    hf_logits = torch.cat([logits, logits[:, :1]], dim=1)  # the last position predicts nothing
    padded = torch.cat([logits, torch.full((2, 24, 7), 50.0)], dim=-1)  # Megatron's padded vocabulary
    mca_sum, mca_tokens = mca_loss.lm_loss(padded, labels, vocab_size=logits.shape[-1])

    trainer = SimpleNamespace(model=SimpleNamespace(training=False))
    standard = TokenMeanLossMixin._token_mean_loss(trainer, SimpleNamespace(logits=hf_logits), hf_labels,
                                                   num_items_in_batch=mca_tokens)
    assert mca_tokens.item() == 43 and mca_sum.dtype == torch.float64
    assert standard.item() == (mca_sum / mca_tokens).float().item()
    assert token_loss_rows(hf_logits, hf_labels).sum(0).tolist() == [mca_sum.item(), 43.0]


def test_both_backends_give_bit_identical_dpo_log_probs(monkeypatch, tiny_model_dir):
    """TRL's fused-head call on the standard backend, re-routed to roll.loss, and the mca backend's sequence
    log-probs: the same float64 row sums of the same logits."""
    pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from backends.mca.trainer import loss as mca_loss
    from backends.standard.dpo_logps import use_roll_log_probs

    _tp1(monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    use_roll_log_probs(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.masked_fill(torch.arange(12) < 4, IGNORE_INDEX)
    with torch.no_grad():
        fused = model(input_ids=ids, labels=labels, fused_lm_head=True)
        logits = model(input_ids=ids).logits
    logps, tokens = mca_loss.sequence_log_probs(logits[:, :-1].clone(), labels[:, 1:], model.config.vocab_size)
    assert fused.log_probs.dtype == torch.float64 and tokens.tolist() == [8, 8]
    assert fused.log_probs.sum(dim=1).tolist() == logps.tolist()
    assert fused.entropy.shape == fused.mean_logits.shape == fused.is_top1.shape == labels[:, 1:].shape


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_the_standard_trainers_take_their_losses_from_roll_loss(tiny_model_dir, tmp_path, monkeypatch, stage):
    """The wiring: a standard-backend step calls roll.loss for its pt/sft loss (compute_loss_func) and for
    the DPO policy and reference log-probs (TRL's fused head re-routed), not the model's or TRL's own."""
    from tests.unit.test_standard_train import train_in_process

    calls = []
    original = roll_loss.token_log_probs

    def spy(logits, labels):
        calls.append(tuple(labels.shape))
        return original(logits, labels)

    monkeypatch.setattr(roll_loss, "token_log_probs", spy)
    _, result, _, _ = train_in_process(tiny_model_dir, tmp_path, stage=stage, max_steps=1, learning_rate=1e-3)
    # per micro-batch: sft once; dpo twice (policy, then the reference model)
    assert len(calls) == (1 if stage == "sft" else 2), calls
    assert len(result.log_history) >= 1


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_pref_ftx_adds_each_chosen_responses_mean_token_nll(monkeypatch, loss_type):
    """pref_ftx (LLaMA-Factory's ftx_gamma): each pair's loss gains ftx times its chosen response's mean
    per-token NLL, whatever pref_loss; the NLL computed here by hand with log_softmax in float64."""
    from backends.mca.trainer import loss as mca_loss

    _tp1(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 7, 11, generator=gen)  # rows: chosen 0, chosen 1, rejected 0, rejected 1
    labels = torch.randint(0, 11, (4, 7), generator=gen)
    labels[0, :2] = labels[1, :5] = labels[2, :3] = labels[3, :1] = IGNORE_INDEX  # prompts of different lengths
    logps, tokens = mca_loss.sequence_log_probs(logits, labels, 11)
    reference = logps.detach() * 0.9
    plain, _, _ = mca_loss.dpo_losses(logps, reference, tokens, mca_loss.DPOSettings(loss_type=loss_type))
    with_ftx, _, _ = mca_loss.dpo_losses(logps, reference, tokens,
                                        mca_loss.DPOSettings(loss_type=loss_type, ftx=0.3))
    log_p = torch.log_softmax(logits.double(), dim=-1)
    nll = [-log_p[row][labels[row] != IGNORE_INDEX].gather(
        -1, labels[row][labels[row] != IGNORE_INDEX].unsqueeze(-1)).mean().item() for row in (0, 1)]
    assert (with_ftx - plain).tolist() == pytest.approx([0.3 * value for value in nll], rel=1e-6)
    # the shared term itself, on float64 sums: -sum / tokens, 0 for a pair without response tokens
    assert roll_loss.chosen_sft_losses(torch.tensor([-6.0, 0.0], dtype=torch.float64),
                                       torch.tensor([3, 0])).tolist() == [2.0, 0.0]


def test_load_balancing_loss_is_megatrons_summed_over_layers_without_padding():
    """roll.loss's MoE balancing loss (the standard backend's) against Megatron-Core's own functions (the mca
    backend's): per layer, padding left out, summed over the layers."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.moe.moe_utils import (compute_routing_scores_for_aux_loss,
                                                         switch_load_balancing_loss_func)

    gen = torch.Generator().manual_seed(5)
    layers = [torch.randn(12, 4, generator=gen) * 2 for _ in range(3)]  # 12 tokens, 4 experts, 3 MoE layers
    padding = torch.tensor([False] * 9 + [True] * 3)
    expected = 0.0
    for logits in layers:
        routing_map, scores = compute_routing_scores_for_aux_loss(logits, 2, "softmax", padding_mask=padding)
        tokens_per_expert = routing_map.sum(dim=0)
        expected += switch_load_balancing_loss_func(scores, tokens_per_expert, tokens_per_expert.sum() / 2, 2, 4,
                                                    1.0).item()
    ours = roll_loss.load_balancing_loss(layers, 2, (~padding).float())
    assert ours.item() == pytest.approx(expected, rel=1e-6)
    # padding counts when it is not masked out: another value
    assert roll_loss.load_balancing_loss(layers, 2, None).item() != pytest.approx(expected, rel=1e-3)
    # a router that spreads every token evenly: 1 per layer
    assert roll_loss.load_balancing_loss([torch.zeros(8, 4)] * 3, 2, None).item() == pytest.approx(3.0)



def test_router_z_loss_is_megatrons_summed_over_layers_without_padding():
    """roll.loss's router z-loss (the standard backend's) against Megatron-Core's ``z_loss_func`` (the mca
    backend's) and against the formula by hand: per layer, padding left out, summed over the layers."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.moe.moe_utils import z_loss_func

    gen = torch.Generator().manual_seed(6)
    layers = [torch.randn(12, 4, generator=gen) * 3 for _ in range(3)]
    padding = torch.tensor([False] * 9 + [True] * 3)
    expected = sum(z_loss_func(logits, 1.0, padding_mask=padding).item() for logits in layers)
    ours = roll_loss.router_z_loss(layers, (~padding).float())
    assert ours.item() == pytest.approx(expected, rel=1e-6)
    by_hand = sum(float(sum(math.log(sum(math.exp(x) for x in row)) ** 2 for row in logits[:9].tolist())) / 9
                  for logits in layers)
    assert ours.item() == pytest.approx(by_hand, rel=1e-5)
    assert roll_loss.router_z_loss(layers, None).item() != pytest.approx(expected, rel=1e-3)  # padding in
    even = roll_loss.router_z_loss([torch.zeros(8, 4)] * 2, None)  # logsumexp of 4 zero logits: ln 4
    assert even.item() == pytest.approx(2 * math.log(4) ** 2)

# ---- the kernel (roll.loss._TokenLogProbs): gradient, ignored labels, padded vocabulary, bf16, memory ----


def _unfused(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The expression the kernel computes, under plain autograd (roll.loss before the kernel): the bitwise
    reference of its forward and backward, and the memory it must not use."""
    mask = labels != IGNORE_INDEX
    logits = logits.float()
    shifted = logits - logits.max(dim=-1, keepdim=True).values.detach()
    predicted = shifted.gather(-1, labels.masked_fill(~mask, 0).unsqueeze(-1)).squeeze(-1)
    return (predicted - shifted.exp().sum(dim=-1).log()).masked_fill(~mask, 0.0)


def _batch(rows: int, vocab: int, padded: int = 0, dtype=torch.float32, seed: int = 0):
    """Logits ``[2, rows, vocab + padded]`` (the padding huge: it must not count), labels with ignored
    positions, and a weight per token for a non-uniform upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, rows, vocab + padded, generator=gen, dtype=torch.float64) * 3 + 20
    logits[..., vocab:] = 1e4
    labels = torch.randint(0, vocab, (2, rows), generator=gen)
    labels[0, :3] = IGNORE_INDEX
    return logits.to(dtype), labels, torch.randn(2, rows, generator=gen, dtype=torch.float64)


def test_kernel_gradcheck_in_float64_ignored_labels_padded_vocab(monkeypatch):
    monkeypatch.setattr(roll_loss, "CHUNK_ELEMENTS", 20)  # several chunks of rows, and a last short one
    logits, labels, _ = _batch(rows=5, vocab=7, padded=3, dtype=torch.float64)
    logits.requires_grad_()

    def log_probs(x):
        return roll_loss.token_log_probs(x, labels, vocab_size=7)[0]

    assert torch.autograd.gradcheck(log_probs, (logits,), eps=1e-6, atol=1e-8)
    out = log_probs(logits)
    reference = torch.log_softmax(logits[..., :7], -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    assert torch.allclose(out, reference.masked_fill(labels == IGNORE_INDEX, 0), rtol=0, atol=1e-12)
    out.sum().backward()
    assert (logits.grad[..., 7:] == 0).all() and (logits.grad[0, :3] == 0).all()  # padding, ignored labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_unfused_expression_to_the_bit_and_float64_within_rounding(monkeypatch, dtype):
    """Forward and gradient equal autograd's over the same expression bit for bit, with the gradient written
    into intermediate logits (bf16 stays bf16); against float64 within float32 / bf16 rounding."""
    monkeypatch.setattr(roll_loss, "CHUNK_ELEMENTS", 3000)
    logits, labels, weight = _batch(rows=40, vocab=500, padded=12, dtype=dtype)
    weight = weight.float()
    leaf, reference_leaf, exact = (logits.clone().requires_grad_() for _ in range(3))
    intermediate = leaf * 1  # a model's output: the kernel may overwrite it
    seen = []
    intermediate.register_hook(lambda grad: seen.append(grad.data_ptr()))
    ours, mask = roll_loss.token_log_probs(intermediate, labels, vocab_size=500)
    assert ours.dtype == torch.float32 and mask.sum().item() == 77
    (ours * weight).sum().backward()
    unfused = _unfused(reference_leaf[..., :500], labels)
    (unfused * weight).sum().backward()
    assert torch.equal(ours, unfused) and torch.equal(leaf.grad, reference_leaf.grad)
    assert leaf.grad.dtype == dtype
    assert seen == [intermediate.data_ptr()]  # in place: no second [tokens, vocab] tensor for the gradient
    exact64 = exact.double()
    (_unfused(exact64[..., :500], labels).double() * weight.double()).sum().backward()
    rounding = 1e-6 if dtype == torch.float32 else 8e-3  # float32 arithmetic; a bf16 gradient's 8 bits
    assert torch.allclose(leaf.grad.double(), exact.grad.double(), rtol=rounding, atol=rounding * 1e-2)
    assert torch.allclose(ours.double(), _unfused(exact64[..., :500], labels).double(), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_saves_only_the_logits_and_per_row_numbers(dtype):
    """What the autograd graph keeps for the backward: the logits themselves (no float32 copy of bf16 logits)
    and per-row tensors; the unfused expression keeps its float32 ``exp`` too, which the second half
    checks, so the count is sharp."""
    logits, labels, _ = _batch(rows=16, vocab=300, dtype=dtype)
    logits.requires_grad_()

    def saved_bytes(fn) -> list[int]:
        sizes = []

        def pack(tensor):
            sizes.append(tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            fn()
        return sorted(sizes, reverse=True)

    rows = labels.numel()
    ours = saved_bytes(lambda: roll_loss.token_log_probs(logits * 1, labels))
    big = [size for size in ours if size > 8 * rows]
    assert big == [logits.numel() * logits.element_size()], ours  # `logits * 1` saves nothing either
    unfused = saved_bytes(lambda: _unfused(logits * 1, labels))
    assert sum(size for size in unfused if size > 8 * rows) >= logits.numel() * 4 + sum(big), unfused
