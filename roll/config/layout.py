"""The parallel layout of a Megatron run, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from roll.errors import ConfigError


@dataclass(frozen=True)
class ParallelLayout:
    """How ``world_size`` ranks split into tensor/pipeline/context/data (and expert) groups.

    Megatron-Core's rules: ``world = tp * pp * cp * dp``; the expert layout re-folds the same
    ranks, so ``etp * ep`` must divide ``tp * cp * dp``. ``sequence_parallel`` is the requested
    value with Megatron's rule applied (this is the one place that applies it): forced on with
    TP>1 and EP>1 or an MoE model (``moe``: its MoE layers refuse to train under TP>1 without it),
    off at TP1 (Megatron refuses it there). Build it once per run
    (``MegatronArguments.build_layout``) and pass the object on.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    sequence_parallel: bool = False
    moe: bool = False
    """The model has routed experts (MoE layers)."""

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{self._field_key(name)} must be >= 1, got {getattr(self, name)}.")
        if self.vpp is not None and self.vpp < 1:
            raise ConfigError(f"virtual_pipeline_model_parallel_size must be >= 1, got {self.vpp}.")
        if self.vpp is not None and self.vpp > 1 and self.pp == 1:
            raise ConfigError("virtual_pipeline_model_parallel_size > 1 needs pipeline_model_parallel_size > 1.")
        if self.etp is not None and self.etp < 1:
            raise ConfigError(f"expert_tensor_parallel_size must be >= 1, got {self.etp}.")
        model_parallel = self.tp * self.pp * self.cp
        if self.world_size % model_parallel:
            raise ConfigError(
                f"tp({self.tp}) * pp({self.pp}) * cp({self.cp}) * dp(?) != world_size({self.world_size}) for any "
                f"dp: tp * pp * cp = {model_parallel} does not divide world_size({self.world_size}). "
                "Change the parallel sizes or nproc_per_node."
            )
        expert = self.expert_tp * self.ep
        if (self.tp * self.cp * self.dp) % expert:
            raise ConfigError(
                f"etp({self.expert_tp}) * ep({self.ep}) = {expert} does not divide tp({self.tp}) * cp({self.cp}) * "
                f"dp({self.dp}) = {self.tp * self.cp * self.dp} (world_size {self.world_size}, pp {self.pp})."
            )
        object.__setattr__(self, "sequence_parallel", self.tp > 1 and (self.sequence_parallel or self.ep > 1
                                                                          or self.moe))

    @staticmethod
    def _field_key(name: str) -> str:
        return {"world_size": "world_size", "tp": "tensor_model_parallel_size",
                "pp": "pipeline_model_parallel_size", "cp": "context_parallel_size",
                "ep": "expert_model_parallel_size"}[name]

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size; Megatron defaults it to tp."""
        return self.tp if self.etp is None else self.etp

    @property
    def vpp_size(self) -> int:
        return self.vpp or 1

    def describe(self) -> str:
        return (f"tp({self.tp}) * pp({self.pp}) * cp({self.cp}) * dp({self.dp}) = world_size({self.world_size}), "
                f"vpp {self.vpp_size}, ep {self.ep}, etp {self.expert_tp}, sp {'on' if self.sequence_parallel else 'off'}")

    def micro_batches_at_least(self, count: int) -> int:
        """The smallest micro-batch count >= ``count`` that Megatron's schedule runs at this layout.

        The interleaved (virtual) pipeline schedule runs a step's M micro-batches in groups of N = pp per
        virtual stage and requires N <= M and M % N == 0 (Megatron's ``microbatch_group_size_per_vp_stage``,
        default pp: "the remainder of M ... divided by N"), i.e. M a multiple of pp. Without VPP any M works.
        """
        if self.vpp_size == 1:
            return count
        return max(1, -(-count // self.pp)) * self.pp

    def check_micro_batches(self, gradient_accumulation_steps: int) -> None:
        """ConfigError naming the nearest valid gradient_accumulation_steps if the schedule would refuse it."""
        valid = self.micro_batches_at_least(gradient_accumulation_steps)
        if valid == gradient_accumulation_steps:
            return
        lower = gradient_accumulation_steps // self.pp * self.pp
        nearest = f"{lower} or {valid}" if lower >= self.pp else f"{valid}"
        raise ConfigError(
            f"gradient_accumulation_steps({gradient_accumulation_steps}) must be a multiple of "
            f"pipeline_model_parallel_size({self.pp}) with virtual_pipeline_model_parallel_size({self.vpp}): "
            "the interleaved pipeline schedule runs each step's micro-batches (one per gradient accumulation "
            "step) in groups of pp per virtual stage, and Megatron refuses a remainder (\"the remainder of M "
            f"... divided by N\"). Nearest valid gradient_accumulation_steps: {nearest} (adjust "
            "per_device_train_batch_size to keep the global batch), or drop "
            "virtual_pipeline_model_parallel_size.")

    def check_num_layers(self, num_layers: int) -> None:
        """Every (virtual) pipeline stage must get the same number of layers."""
        check_num_layers(num_layers, self.pp, self.vpp)


def check_num_layers(num_layers: int, pp: int, vpp: int | None) -> None:
    """Every (virtual) pipeline stage must get the same number of layers (also checked by the
    Megatron model config, which may be built without a layout, e.g. from ``mca_config.json``)."""
    stages = pp * (vpp or 1)
    if num_layers % stages:
        raise ConfigError(
            f"num_layers({num_layers}) is not divisible by pp({pp}) * vpp({vpp or 1}) = {stages}. "
            "Change pipeline_model_parallel_size or virtual_pipeline_model_parallel_size."
        )
