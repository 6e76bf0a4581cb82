"""Layout planner (``roll-train RECIPE --plan``): the memory one GPU rank needs for a run, from its config.

Nothing heavy is loaded: the model shape comes from ``config.json`` read as JSON (never ``AutoConfig``, which
may reach the network), or from the small built-in table below for the Hub ids the recipes name. Per rank:
parameters, gradients and optimizer states (precision, Megatron's distributed optimizer or the DeepSpeed ZeRO
stage, CPU offload, LoRA, MoE expert parallelism), activations of the micro-batches in flight (Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models"), logits, and a runtime reserve,
against ``gpu_memory_gb``. The formulas and the measured error are in docs/planner.md. Backend-agnostic: the
backends' choices it models (fp32 gradient buffers on mca, fp32 load + autocast on standard) are written as
data (roll.plan.strategy) and checked by the measurement test, not imported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from roll.config.run import RunConfig
from roll.plan.shape import ATTENTION, ModelShape, resolve_shape
from roll.plan.strategy import Strategy, strategy_for

GIB = 2 ** 30
RUNTIME_RESERVE_BYTES = 2 * GIB
"""CUDA context (~0.5 GiB on an H100), NCCL buffers and caching-allocator slack: an estimate, not measured
(no GPU run so far; docs/planner.md)."""


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank of a pipeline stage holds: outside routed experts (dense) and routed experts."""

    dense: float
    expert: float
    trainable_dense: float
    trainable_expert: float
    largest_module: float  # the biggest single layer or embedding, unsharded (what ZeRO-3 gathers at once)


def _lora_params(targets: list[str] | str, rank: int, dims: dict[str, tuple[int, int]]) -> int:
    return sum(rank * (i + o) for name, (i, o) in dims.items() if targets == "all" or name in targets)


def stage_params(shape: ModelShape, st: Strategy, finetuning, stage: int) -> StageParams:
    """Parameter counts on one rank of pipeline stage ``stage`` (TP, EP/ETP and PP applied)."""
    layers, h, tp = shape.num_layers // st.pp, shape.hidden_size, st.tp
    moe_frac = shape.moe_layers / shape.num_layers
    mlp = (1 - moe_frac) * shape.dense_mlp_params() + moe_frac * shape.moe_dense_params()
    layer_dense = (shape.attention_params() + mlp) / tp + 2 * h  # the two norms are replicated
    layer_expert = moe_frac * shape.expert_params() / (st.ep * st.etp)
    vocab = -(-shape.vocab_size // st.vocab_multiple) * st.vocab_multiple
    first, last = stage == 0, stage == st.pp - 1
    embed = vocab * h / tp if first else 0
    head = vocab * h / tp + h if last and (not shape.tie_word_embeddings or st.pp > 1) else (h if last else 0)
    dense, expert = layers * layer_dense + embed + head, layers * layer_expert
    largest = max(shape.attention_params() + mlp + moe_frac * shape.expert_params(), vocab * h)
    vision = shape.vision if first else None  # mca: the whole HF tower on every TP rank of stage 0 (docs/vl.md)
    if vision is not None:
        dense += vision.total_params()
        largest = max(largest, vision.block_params(), vision.merger_params())
    kind = finetuning.finetuning_type
    if kind == "full" and vision is not None:
        trained_vision = (0 if finetuning.freeze_vision_tower else vision.tower_params()) \
            + (0 if finetuning.freeze_multi_modal_projector else vision.merger_params())
        trained_text = 0 if finetuning.freeze_language_model else dense - vision.total_params()
        return StageParams(dense, expert, trained_text + trained_vision,
                           0 if finetuning.freeze_language_model else expert, largest)
    if kind == "lora":
        proj = shape.projections()
        attn = {k: v for k, v in proj.items() if k in ATTENTION}
        mlp_dims = {k: v for k, v in proj.items() if k not in attn}
        ffn = shape.moe_intermediate_size
        moe_dims = {k: (h if i == h else ffn, h if o == h else ffn) for k, (i, o) in mlp_dims.items()}
        r, targets = finetuning.lora_rank, finetuning.lora_targets
        dense_lora = _lora_params(targets, r, attn) + (1 - moe_frac) * _lora_params(targets, r, mlp_dims)
        expert_lora = moe_frac * shape.num_experts * _lora_params(targets, r, moe_dims)
        adapters_dense, adapters_expert = layers * dense_lora / tp, layers * expert_lora / (st.ep * st.etp)
        return StageParams(dense + adapters_dense, expert + adapters_expert, adapters_dense, adapters_expert,
                           largest)
    if kind == "freeze":  # only the last freeze_trainable_layers layers train (embeddings and head frozen)
        lo = max(shape.num_layers - finetuning.freeze_trainable_layers, stage * layers)
        trained = max(0, (stage + 1) * layers - lo)
        return StageParams(dense, expert, trained * layer_dense, trained * layer_expert, largest)
    return StageParams(dense, expert, dense, expert, largest)


def activation_bytes(shape: ModelShape, st: Strategy, seq: int, batch: int, micro_batches: int,
                     stage: int) -> float:
    """Activations one rank of ``stage`` keeps for backward (Korthikanti et al. 2022, eqs. 1-5, 16-bit).

    Per layer and micro-batch: s*b*h*(34 + 5*a*s/h) bytes; the 5*a*s/h term (the s x s attention scores,
    softmax and dropout mask) vanishes with a flash kernel or selective recompute; TP with SP divides all of
    it by t, TP alone only 24 of the 34; CP divides by cp; full recompute keeps each layer's input (2*s*b*h,
    /t with SP) plus one recompute group's full activations. 1F1B keeps pp - stage micro-batches in flight.
    """
    s, b, h, a, tp = seq, batch, shape.hidden_size, shape.num_heads, st.tp
    attn = 0.0 if st.flash or st.recompute == "selective" else 5 * a * s / h
    if tp > 1 and st.sp:
        per_token = (34 + attn) / tp
    else:
        per_token = 10 + (24 + attn) / tp if tp > 1 else 34 + attn
    scale = st.act_bytes / 2 / st.cp  # the paper counts 16-bit activations
    full = s * b * h * per_token * scale
    layers = shape.num_layers // st.pp
    in_flight = min(st.pp - stage, micro_batches)
    if st.vpp > 1 and stage == 0:
        in_flight *= 1 + (st.pp - 1) / (st.pp * st.vpp)
    if st.recompute != "full":
        return full * layers * in_flight
    inputs = s * b * h * 2 * scale / (tp if st.sp else 1)
    group = min(st.recompute_num_layers, layers)
    if st.recompute_method == "block":  # the first `group` layers of the stage recomputed, the rest stored
        return (group * inputs + (layers - group) * full) * in_flight + full
    return layers * inputs * in_flight + group * full


@dataclass(frozen=True)
class PlanLine:
    key: str
    bytes: float
    detail: str


@dataclass
class MemoryPlan:
    """The per-rank memory of the fullest pipeline stage, and whether it fits ``gpu_memory_gb``."""

    backend: str
    setup: str
    model: str
    stage: int
    lines: list[PlanLine]
    gpu_memory_gb: float
    cpu_offload_bytes: float
    suggestions: list[str]

    @property
    def total_bytes(self) -> float:
        return sum(line.bytes for line in self.lines)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.gpu_memory_gb * GIB

    def to_dict(self) -> dict:
        return {"backend": self.backend, "setup": self.setup, "model": self.model, "stage": self.stage,
                "lines": [{**asdict(line), "gib": line.bytes / GIB} for line in self.lines],
                "total_bytes": self.total_bytes, "total_gib": self.total_bytes / GIB,
                "gpu_memory_gb": self.gpu_memory_gb, "fits": self.fits,
                "cpu_offload_gib": self.cpu_offload_bytes / GIB, "suggestions": self.suggestions}

    def format(self) -> str:
        out = [f"roll-train --plan: {self.backend} backend, {self.setup}", f"model: {self.model}",
               f"per-rank memory of pipeline stage {self.stage} (the fullest; 1 GiB = 2^30 bytes):"]
        out += [f"  {line.key:<18}{line.bytes / GIB:9.2f} GiB   {line.detail}" for line in self.lines]
        used = self.total_bytes / GIB
        verdict = "fits" if self.fits else "does not fit"
        out.append(f"  {'total':<18}{used:9.2f} GiB   of gpu_memory_gb={self.gpu_memory_gb:g}: {verdict} "
                   f"({100 * used / self.gpu_memory_gb:.0f}% used)")
        if self.cpu_offload_bytes:
            out.append(f"  (+ {self.cpu_offload_bytes / GIB:.2f} GiB offloaded to CPU memory per rank)")
        if not self.fits:
            out.append("to make it fit, any of:")
            out += [f"  - {tip}" for tip in self.suggestions]
        return "\n".join(out) + "\n"


def _state_lines(shape: ModelShape, st: Strategy, p: StageParams,
                 config: RunConfig) -> tuple[list[PlanLine], float]:
    """Parameters, gradients, optimizer states (and DDP / ZeRO buffers, a DPO reference); and CPU bytes."""
    w = {2: "16-bit", 4: "fp32"}
    params = (p.dense + p.expert) * st.weight_bytes / st.param_shard
    trainable = p.trainable_dense + p.trainable_expert
    where = f"ZeRO-{st.zero_stage}" if st.zero_stage is not None else "distributed optimizer"
    optim = (p.trainable_dense / st.optim_shard + p.trainable_expert / st.expert_optim_shard) * st.optim_bytes
    split = f"TP{st.tp}" + (f", EP{st.ep}" if shape.num_experts else "") \
        + (f", PP{st.pp}" if st.pp > 1 else "")
    lines = [
        PlanLine("parameters", 0.0 if st.params_on_cpu else params,
                 f"{w[st.weight_bytes]}, {(p.dense + p.expert) / 1e9:.3g}B on this rank ({split})"
                 + (f", /{st.param_shard} ZeRO-3" if st.param_shard > 1 else "")
                 + (" -> offloaded to CPU" if st.params_on_cpu else "")),
        PlanLine("gradients", trainable * st.grad_bytes / st.grad_shard,
                 f"{w[st.grad_bytes]}, {trainable / 1e9:.3g}B trainable"
                 + (f", /{st.grad_shard} ZeRO-{st.zero_stage}" if st.grad_shard > 1 else ", not sharded")),
        PlanLine("optimizer states", 0.0 if st.optimizer_on_cpu else optim,
                 f"Adam m, v{' + fp32 master' if st.optim_bytes == 12 else ''} ({st.optim_bytes} B/param)"
                 + (f", /{st.optim_shard} {where}" if st.optim_shard > 1 else ", not sharded")
                 + (f" (experts /{st.expert_optim_shard})"
                    if shape.num_experts and st.optim_shard > 1 else "")
                 + (" -> offloaded to CPU" if st.optimizer_on_cpu else "")),
    ]
    if st.ddp_buckets:
        lines.append(PlanLine("DDP buckets", trainable * st.grad_bytes, "torch DDP's copy of the gradients"))
    if st.zero_stage:
        bucket = min(st.reduce_bucket, trainable) * st.grad_bytes
        lines.append(PlanLine("ZeRO grad buffers", bucket + trainable * 4 / st.optim_shard,
                              f"reduce bucket of {min(st.reduce_bucket, trainable) / 1e6:.4g}M elements "
                              f"+ fp32 gradient partition (4 B/param, /{st.optim_shard})"))
    if st.zero_stage == 3:
        lines.append(PlanLine("ZeRO-3 gathers", 2 * p.largest_module * st.weight_bytes,
                              "current + prefetched layer (or embedding), gathered in full"))
    ft = config.finetuning
    if ft.stage in ("dpo", "kto") and not ft.reference_free and ft.finetuning_type != "lora":  # LoRA: adapters off
        lines.append(PlanLine("reference model", params,
                              f"frozen copy of the policy for {ft.stage.upper()} (same sharding)"))
    cpu = (optim if st.optimizer_on_cpu else 0.0) + (params if st.params_on_cpu else 0.0)
    return lines, cpu


def _stage_lines(shape: ModelShape, st: Strategy, config: RunConfig,
                 stage: int) -> tuple[list[PlanLine], float]:
    t, d = config.training, config.data
    pairs = config.finetuning.stage in ("dpo", "rm")
    batch = t.per_device_train_batch_size * (2 if pairs else 1)  # DPO, rm: chosen + rejected
    p = stage_params(shape, st, config.finetuning, stage)
    lines, cpu = _state_lines(shape, st, p, config)
    recompute = st.recompute or "no"
    lines.append(PlanLine(
        "activations", activation_bytes(shape, st, d.cutoff_len, batch, t.gradient_accumulation_steps, stage),
        f"s={d.cutoff_len} b={batch}, {recompute} recompute, {'flash' if st.flash else 'unfused'} attention"
        + (f", SP over TP{st.tp}" if st.sp else "") + (f", CP{st.cp}" if st.cp > 1 else "")
        + (f", {min(st.pp - stage, t.gradient_accumulation_steps)} micro-batches in flight"
           if st.pp > 1 else "")))
    if shape.vision is not None and stage == 0:
        lines.append(_vision_activations(shape, st, config, batch))
        if shape.vision.deepstack_mergers:
            lines.append(_deepstack_features(shape, st, config, batch))
    if stage == st.pp - 1 and config.finetuning.stage != "rm":  # a reward model's head is 1 wide: no logits
        vocab = -(-shape.vocab_size // st.vocab_multiple) * st.vocab_multiple
        lines.append(PlanLine("logits", d.cutoff_len * batch * vocab * 4 / st.tp,
                              f"fp32 s*b*V{f'/TP{st.tp}' if st.tp > 1 else ''}, V={vocab}"))
    lines.append(PlanLine("runtime reserve", RUNTIME_RESERVE_BYTES,
                          "CUDA context, NCCL, allocator slack (estimate)"))
    return lines, cpu


def _vision_activations(shape: ModelShape, st: Strategy, config: RunConfig, batch: int) -> PlanLine:
    """The vision tower's activations, at most: every token of the micro-batch an image token (merge^2 patches
    each). The tower is not tensor- or sequence-parallel (one replica per TP rank); its blocks recompute when the
    language model's layers do (the standard backend's gradient_checkpointing; mca's recompute_granularity, either
    granularity: ``backends.mca.models.qwen2_5_vl.build_vision_tower``)."""
    ft, vision = config.finetuning, shape.vision
    patches = config.data.cutoff_len * batch * vision.merge ** 2
    train_tower, train_merger = ft.finetuning_type == "full" and not ft.freeze_vision_tower, \
        ft.finetuning_type == "full" and not ft.freeze_multi_modal_projector
    recompute = st.recompute is not None
    frozen = "tower and merger frozen: no activations kept" if not (train_tower or train_merger) else (
        f"tower {'trained' if train_tower else 'frozen'}, merger {'trained' if train_merger else 'frozen'}"
        + (", blocks recomputed" if recompute and train_tower else ""))
    return PlanLine("vision activations",
                    vision.activation_bytes(patches, st.act_bytes, train_tower, train_merger, recompute),
                    f"at most {patches} patches (every token an image's), {frozen}")


def _deepstack_features(shape: ModelShape, st: Strategy, config: RunConfig, batch: int) -> PlanLine:
    """Qwen3-VL's deepstack features on stage 0, at most (every token an image token): ``n * s * b * h`` in the
    activation dtype, split like the sequence (mca: /TP with SP, /CP). Nothing saves them for backward (adding them
    and scattering them in keep no operand), so one micro-batch's exist at a time, during its forward; but a full
    recompute saves each micro-batch's (mca: the decoder block's ``context``) until its backward, 1F1B's in-flight
    micro-batches on stage 0 (the standard backend's checkpointed layers do not take them)."""
    vision, tokens = shape.vision, config.data.cutoff_len * batch
    split = st.cp * (st.tp if st.sp else 1)
    kept = st.backend == "mca" and st.recompute == "full"
    copies = min(st.pp, config.training.gradient_accumulation_steps) if kept else 1
    detail = (f"{vision.deepstack_mergers} x s*b*h, s={config.data.cutoff_len} b={batch} h={vision.out_hidden_size}"
              + (f", /{split} (the rank's part of the sequence)" if split > 1 else "")
              + (f", kept by full recompute for {copies} micro-batches in flight" if kept else ", during the forward"))
    return PlanLine("deepstack features", vision.deepstack_bytes(tokens, st.act_bytes) / split * copies, detail)


def _suggestions(st: Strategy, shape: ModelShape, config: RunConfig, lines: list[PlanLine]) -> list[str]:
    """What to change, the fix for the largest part first."""
    t, by = config.training, {line.key: line.bytes for line in lines}
    state, acts = [], []
    b = t.per_device_train_batch_size
    if st.backend == "mca":
        if st.optim_shard == 1 and st.dp * st.cp > 1:
            state.append(f"use_distributed_optimizer: true (shards optimizer states over {st.dp * st.cp} "
                         "ranks)")
        state.append(f"raise tensor_model_parallel_size (now {st.tp}) or pipeline_model_parallel_size (now "
                     f"{st.pp}): both divide parameters, gradients, optimizer states and activations")
        if shape.num_experts and st.ep < shape.num_experts:
            state.append(f"raise expert_model_parallel_size (now {st.ep}) to spread the experts")
        if not st.optimizer_on_cpu:
            state.append("optimizer_cpu_offload: true (optimizer states and fp32 masters in CPU memory)")
        if st.recompute != "full":
            acts.append("recompute_granularity: full (keeps only each layer's input)")
        acts.append(f"raise context_parallel_size (now {st.cp}) or lower cutoff_len (now "
                    f"{config.data.cutoff_len})")
    else:
        if (st.zero_stage or 0) < 3:
            state.append("deepspeed: recipes/deepspeed/ds_z3.json (ZeRO-3 shards parameters, gradients and "
                         f"optimizer states over all {st.world_size} ranks)")
        elif not st.optimizer_on_cpu:
            state.append("deepspeed: recipes/deepspeed/ds_z3_offload.json (ZeRO-3 with CPU offload)")
        state.append("--use-mca with tensor/pipeline parallelism and use_distributed_optimizer: true")
        if not t.gradient_checkpointing:
            acts.append("gradient_checkpointing: true (keeps only each layer's input)")
        acts.append(f"lower cutoff_len (now {config.data.cutoff_len})")
    if b > 1:
        acts.insert(0, f"lower per_device_train_batch_size (now {b}) and raise gradient_accumulation_steps "
                       "to keep the global batch")
    states = by["parameters"] + by["gradients"] + by["optimizer states"]
    if by.get("activations", 0) + by.get("logits", 0) > states:
        return acts + state
    return state + acts


def plan_run(config: RunConfig, gpu_memory_gb: float | None = None) -> MemoryPlan:
    """The plan of a validated RunConfig: the fuller of the first and last pipeline stage."""
    shape, source = resolve_shape(config.model.model_name_or_path)
    if config.layout is not None:  # validate() checked this only for a local config.json
        config.layout.check_num_layers(shape.num_layers)
    st = strategy_for(config, shape)
    best: tuple[float, int, list[PlanLine], float] | None = None
    for stage in sorted({0, st.pp - 1}):
        lines, cpu = _stage_lines(shape, st, config, stage)
        total = sum(line.bytes for line in lines)
        if best is None or total > best[0]:
            best = (total, stage, lines, cpu)
    _, stage, lines, cpu = best
    t = config.training
    if st.backend == "mca":
        setup = config.layout.describe()
    else:
        setup = f"{st.world_size} rank(s), data parallel" + (
            f", DeepSpeed ZeRO-{st.zero_stage}" if st.zero_stage is not None else ", no DeepSpeed")
    setup += f", {st.precision}, micro-batch {t.per_device_train_batch_size} x gradient_accumulation_steps " \
             f"{t.gradient_accumulation_steps}"
    model = (f"{config.model.model_name_or_path}: {shape.total_params() / 1e9:.3g}B parameters (hidden "
             f"{shape.hidden_size}, {shape.num_layers} layers, {shape.num_heads} heads / "
             f"{shape.num_kv_heads} KV, "
             f"vocab {shape.vocab_size}" + (f", {shape.num_experts} experts top-{shape.experts_per_token}"
                                            if shape.num_experts else "")
             + (f", vision tower + merger {shape.vision.total_params() / 1e9:.3g}B" if shape.vision else "")
             + f"); shape from {source}")
    capacity = t.gpu_memory_gb if gpu_memory_gb is None else gpu_memory_gb
    return MemoryPlan(st.backend, setup, model, stage, lines, capacity, cpu,
                      _suggestions(st, shape, config, lines))
