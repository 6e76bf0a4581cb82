"""Platform layer of the mca backend: CPU compat gating, transformer_impl choice, layer specs,
CP token layout, and initialize_megatron's idempotence and seeding (in a subprocess, because
initialising patches this process for good)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from roll.errors import ConfigError
from roll.platform import Platform
from tests.helpers import REPO, cpu_only, output_of, results, run

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.mca

WORKERS = os.path.join(REPO, "tests", "distributed", "_mca_workers")


def _config(**overrides):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                  normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                  use_cpu_initialization=True, params_dtype=torch.float32)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


# -- transformer_impl ---------------------------------------------------------------------------------

@cpu_only
def test_auto_and_local_resolve_to_local_without_a_gpu():
    from backends.mca.spec import resolve_transformer_impl

    assert resolve_transformer_impl("auto") == "local"
    assert resolve_transformer_impl("local") == "local"


@cpu_only
def test_transformer_engine_without_a_gpu_is_a_clear_error():
    from backends.mca.spec import resolve_transformer_impl

    with pytest.raises(ConfigError, match="transformer_impl: transformer_engine needs Transformer Engine"):
        resolve_transformer_impl("transformer_engine")
    with pytest.raises(ConfigError, match="must be one of auto, local, transformer_engine; got 'te'"):
        resolve_transformer_impl("te")


# -- layer specs --------------------------------------------------------------------------------------

def test_local_dense_spec_uses_local_attention_and_rmsnorm():
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from backends.mca.attention import LocalCoreAttention
    from backends.mca.spec import gpt_layer_spec

    spec = gpt_layer_spec(_config(), "local")
    attn = spec.submodules.self_attention.submodules
    assert attn.core_attention is LocalCoreAttention
    assert attn.q_layernorm is IdentityOp and attn.k_layernorm is IdentityOp
    assert spec.submodules.input_layernorm is WrappedTorchNorm
    assert spec.submodules.mlp.module is MLP


def test_local_spec_qk_norm_and_moe():
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from backends.mca.spec import gpt_layer_spec

    spec = gpt_layer_spec(_config(qk_layernorm=True, num_moe_experts=4, moe_router_topk=2), "local")
    attn = spec.submodules.self_attention.submodules
    assert attn.q_layernorm is not IdentityOp and attn.k_layernorm is not IdentityOp
    assert spec.submodules.mlp.module is MoELayer
    assert spec.submodules.mlp.submodules.experts.module is SequentialMLP


def test_local_spec_rejects_grouped_gemm_without_a_kernel():
    from backends.mca.spec import gpt_layer_spec

    config = _config(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True)
    with pytest.raises(ConfigError, match="set moe_grouped_gemm: false"):
        gpt_layer_spec(config, "local")


# -- context-parallel token layout --------------------------------------------------------------------

def test_cp_token_index_follows_megatron_load_balancing():
    from backends.mca.attention import cp_token_index

    one_seq = torch.tensor([0, 8])
    assert cp_token_index(one_seq, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_token_index(one_seq, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_token_index(one_seq, 1, 0).tolist() == list(range(8))
    assert cp_token_index(torch.tensor([0, 5, 12]), 1, 0).tolist() == list(range(12))  # odd lengths: fine at CP1
    packed = torch.tensor([0, 4, 12])  # sequences of 4 and 8 tokens: chunks of 1 and 2
    assert cp_token_index(packed, 2, 0).tolist() == [0, 3, 4, 5, 10, 11]
    assert cp_token_index(packed, 2, 1).tolist() == [1, 2, 6, 7, 8, 9]


def test_cp_token_index_rejects_unpadded_sequences():
    from backends.mca.attention import cp_token_index

    with pytest.raises(ValueError, match="divisible by 2 \\* cp = 4; got a sequence of 6 tokens"):
        cp_token_index(torch.tensor([0, 6]), 2, 0)


def _per_sequence_attention(q, k, v, cu: list[int]) -> torch.Tensor:
    """Independent reference: SDPA's own causal attention over each packed sequence alone ([t, h, d] in/out)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    outs = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True)
            for a, b in zip(cu[:-1], cu[1:])]
    return torch.cat([o.transpose(0, 1) for o in outs])


def test_packed_windows_hold_whole_sequences_and_equal_per_sequence_attention():
    """roll's packed batches at seq 256: many short samples per row. Windows of whole sequences (first fit, at
    least WINDOW_MIN slots) compute the attention each sequence gets alone, forward and backward, in far fewer
    scores than the t x t stream; a stream that is one long sequence (or fits one window) keeps the stream form."""
    from backends.mca.attention import WINDOW_MIN, PackedWindows

    torch.manual_seed(0)
    lengths = [37, 90, 5, 128, 61, 1, 70, 110]  # 128: a sequence that fills a window alone
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    t = cu[-1]
    windows = PackedWindows.plan(cu)
    assert windows.size == 128 > WINDOW_MIN and windows.count == 5  # the longest; [37 90 1] [5 61] [128] [70] [110]
    assert windows.count * windows.size ** 2 < t * t / 3
    assert sorted(windows.gather[windows.scatter].tolist()) == list(range(t))  # every token has its own slot
    q = torch.randn(t, 4, 8, requires_grad=True, dtype=torch.float64)
    k, v = (torch.randn(t, 2, 8, requires_grad=True, dtype=torch.float64) for _ in range(2))
    out = windows.merge(F.scaled_dot_product_attention(
        *(windows.split(x).permute(1, 2, 0, 3) for x in (q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))),
        attn_mask=windows.allowed).permute(2, 0, 1, 3))
    expected = _per_sequence_attention(q, k, v, cu)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert PackedWindows.plan([0, 300]) is None and PackedWindows.plan([0, 20, 50]) is None  # one window anyway
    assert PackedWindows.plan([0, 200, 300]).count == 2  # [200] [100]: 2 x 200^2 < 300^2


# -- compat patch gating (fake patches: the real ones would change this process for good) -------------

@pytest.fixture
def fake_patches(monkeypatch):
    from packaging.version import Version

    import backends.mca.platform as platform

    calls: list[str] = []
    conditions = {"cpu": True, "no_te": True}
    patches = (platform._Patch("cpu_only", lambda: calls.append("cpu_only"), "never", lambda: conditions["cpu"]),
               platform._Patch("old_bug", lambda: calls.append("old_bug"), "min 0.19", lambda: conditions["no_te"],
                               fixed_in=Version("0.19")))
    monkeypatch.setattr(platform, "_PATCHES", patches)
    monkeypatch.setattr(platform, "_applied", [])
    return platform, calls, conditions


def test_patches_are_idempotent_and_version_gated(fake_patches, monkeypatch):
    from packaging.version import Version

    platform, calls, _ = fake_patches
    monkeypatch.setattr(platform, "megatron_core_version", lambda: Version("0.16.1"))
    platform.apply_patches()
    platform.apply_patches()
    assert calls == ["cpu_only", "old_bug"]
    assert platform.applied_patches() == ("cpu_only", "old_bug")

    monkeypatch.setattr(platform, "_applied", [])
    calls.clear()
    monkeypatch.setattr(platform, "megatron_core_version", lambda: Version("0.19.2"))
    platform.apply_patches()
    assert calls == ["cpu_only"]  # fixed upstream: skipped


def test_each_patch_follows_its_own_condition(fake_patches, monkeypatch):
    """A GPU without TE gets the no-TE fix but none of the CPU ones; a GPU with TE gets nothing."""
    from packaging.version import Version

    platform, calls, conditions = fake_patches
    monkeypatch.setattr(platform, "megatron_core_version", lambda: Version("0.16.1"))
    conditions.update(cpu=False, no_te=False)
    platform.apply_patches()
    assert calls == [] and platform.applied_patches() == ()
    conditions.update(no_te=True)
    platform.apply_patches()
    assert calls == ["old_bug"] and platform.applied_patches() == ("old_bug",)


@cpu_only
def test_real_patch_conditions_on_this_machine(monkeypatch):
    import backends.mca.platform as platform

    needed = {p.name: p.needed for p in platform._PATCHES}
    assert set(needed) == {"rng_tracker", "current_device", "default_causal_mask", "hardcoded_cuda",
                           "moe_router_without_te", "cuda_streams", "moe_split_sizes",
                           "torch_norm_sequence_parallel", "gloo_uneven_first_dim", "distopt_step_on_load",
                           "foreach_multi_tensor_scale", "expert_bias_padding_mask", "mla_without_te",
                           "mla_rope_key_grad", "restricted_checkpoint_reads", "moe_z_loss_scale_per_token",
                           "wgrad_into_main_grad"}
    # this CPU machine has no accelerator, no TE and no Apex, and its collectives run on gloo
    assert all(condition() for condition in needed.values())
    monkeypatch.setattr(platform, "current_platform", lambda: Platform("cuda", "nccl"))
    on_gpu = {name for name, condition in needed.items() if condition()}
    # a GPU without TE/Apex still needs the MoE-router, torch-norm, torch-AdamW, multi-tensor and wgrad fixes, none of
    # the CPU ones; checkpoint reads are restricted, the expert-bias count fixed and the z-loss's scale (megatron's
    # bug) corrected on any device, and so is multi-latent attention's RoPE-key gradient under TP (megatron's bug)
    assert on_gpu == {"moe_router_without_te", "torch_norm_sequence_parallel", "distopt_step_on_load",
                      "foreach_multi_tensor_scale", "expert_bias_padding_mask", "mla_without_te",
                      "mla_rope_key_grad", "restricted_checkpoint_reads", "moe_z_loss_scale_per_token",
                      "wgrad_into_main_grad"}


# -- initialize_megatron (one process, no launcher) ---------------------------------------------------

@cpu_only
def test_initialize_megatron_single_process_idempotent_and_reproducible():
    proc = run([sys.executable, os.path.join(WORKERS, "platform_init.py"), "single"], timeout=120)
    assert proc.returncode == 0, output_of(proc)
    result = results(proc.stdout)[0]
    assert result["info"] == {"rank": 0, "world_size": 1, "local_rank": 0, "dp_rank": 0, "dp_size": 1}
    assert {"rng_tracker", "current_device", "hardcoded_cuda", "moe_split_sizes"} <= set(result["patches"])
    # Same seed after destroy + re-init: every generator restarts identically.
    assert result["first"] == result["again"]
    # The TP tracker is its own stream, not the default generator's.
    assert result["first"]["tp_tracker"][:2] != result["first"]["torch"]
    assert "cannot re-initialise with tp(2)" in result["conflict_error"]
    assert "expects world_size 2" in result["world_error"] and "has 1 processes" in result["world_error"]
    # wgrad_into_main_grad (tests/distributed/_mca_workers/wgrad_checks.py): every main_grad equals the unfused
    # backward's bit for bit (tied and untied, fp32 and bf16 weights, 1 and 3 micro-batches, 2 steps), and an
    # fp32 step with one micro-batch makes no fresh [vocab, hidden] tensor (the unfused one makes 3 tied, 2 untied)
    wgrad = result["wgrad"]
    assert len(wgrad) == 8 and all(case["unequal"] == [] and case["nonzero"] for case in wgrad.values()), wgrad
    assert (wgrad["tied_fp32_ga1"]["vocab_hidden_fused"], wgrad["tied_fp32_ga1"]["vocab_hidden_plain"]) == (0, 6)
    assert (wgrad["untied_fp32_ga1"]["vocab_hidden_fused"], wgrad["untied_fp32_ga1"]["vocab_hidden_plain"]) == (0, 4)
    # later micro-batches keep today's order: the head's gradient is made and added as before
    assert wgrad["tied_fp32_ga3"]["vocab_hidden_fused"] == 4 and wgrad["untied_fp32_ga3"]["vocab_hidden_fused"] == 4


def test_foreach_multi_tensor_scale_gives_the_local_fallbacks_bits():
    """The clipping scale (in place) and the main-to-model copy (another dtype, scale 1) of
    ``foreach_multi_tensor_scale`` equal megatron-core's own ``local_multi_tensor_scale`` bit for bit."""
    from megatron.core.utils import local_multi_tensor_scale

    from backends.mca.multi_tensor import foreach_multi_tensor_scale

    torch.manual_seed(0)
    grads = [torch.randn(17, 5), torch.randn(3), torch.randn(2, 2, 9)]
    ours, megatrons = [g.clone() for g in grads], [g.clone() for g in grads]
    foreach_multi_tensor_scale(0, None, [ours, ours], 0.123456789)
    local_multi_tensor_scale(0, None, [megatrons, megatrons], 0.123456789)
    assert all(torch.equal(a, b) for a, b in zip(ours, megatrons))
    assert not torch.equal(ours[0], grads[0])  # it scaled
    for scale in (1.0, 0.5):
        ours_bf16, megatrons_bf16 = [torch.empty_like(g, dtype=torch.bfloat16) for g in grads], \
            [torch.empty_like(g, dtype=torch.bfloat16) for g in grads]
        foreach_multi_tensor_scale(0, None, [grads, ours_bf16], scale)
        local_multi_tensor_scale(0, None, [grads, megatrons_bf16], scale)
        assert all(torch.equal(a, b) for a, b in zip(ours_bf16, megatrons_bf16)), scale
