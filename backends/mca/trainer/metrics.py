"""What a Megatron run reports, on global rank 0, with the standard backend's names and places.

- a progress bar (steps, with the last logged loss, tokens/s, mfu and peak memory);
- ``OUTPUT_DIR/train_log.jsonl``: one JSON object per logging step: ``step``, ``loss`` (mean of the
  step losses since the previous log, as HF Trainer logs it), ``grad_norm`` (last step),
  ``learning_rate`` (the one the last update used), ``tokens_per_second`` (real tokens, all ranks),
  ``epoch``, the speed fields of ``roll.perf`` (``step_time``: seconds per step of the window, ``mfu``:
  model FLOPs utilisation, 0..1, ``peak_memory_gb``: the largest peak of any rank), plus ``moe_aux_loss``
  for MoE models and ``skipped_steps`` once a step was skipped; evaluation records carry ``eval_loss``;
- TensorBoard scalars (``train/loss``, ...) with ``report_to: tensorboard``, under ``TENSORBOARD_LOGGING_DIR``
  or ``OUTPUT_DIR/runs`` (as Hugging Face's TensorBoard callback).
"""

from __future__ import annotations

import logging
import os

from roll import reward
from roll.logging import is_rank0, warn_once
from roll.perf import SpeedMeter, training_dtype
from roll.train_log import append_record, start_train_log, train_log_path

logger = logging.getLogger(__name__)


def report_targets(report_to) -> set[str]:
    """HF's ``report_to`` (a name, a list, 'all' or 'none') as a set of names."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    names = {str(n).strip().lower() for n in names}
    if "all" in names:
        names = {"tensorboard"}
    return names - {"none", ""}


class MetricsWriter:
    """Progress bar, JSONL log and TensorBoard of one run; a no-op on ranks other than 0."""

    def __init__(self, output_dir: str, total_steps: int, *, initial_step: int = 0, fresh: bool = True,
                 report_to=None) -> None:
        self.enabled = is_rank0()
        self.output_dir, self.path = output_dir, train_log_path(output_dir)
        self.history: list[dict] = []
        self._bar = self._tensorboard = None
        if not self.enabled:
            return
        start_train_log(output_dir, fresh=fresh)
        if "tensorboard" in report_targets(report_to):
            log_dir = os.path.expanduser(os.environ.get("TENSORBOARD_LOGGING_DIR") or os.path.join(output_dir, "runs"))
            self._tensorboard = _tensorboard_writer(log_dir)
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total_steps, initial=initial_step, desc="training", unit="step", dynamic_ncols=True)

    def step_done(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def log(self, step: int, record: dict[str, float]) -> None:
        """Append ``{"step": step, **record}`` to the log (rank 0), TensorBoard and the bar."""
        self.history.append(append_record(self.output_dir, step, record))
        if not self.enabled:
            return
        if self._tensorboard is not None:
            for key, value in ((k, v) for k, v in record.items() if v is not None):  # null: not computable
                self._tensorboard.add_scalar(f"train/{key}" if not key.startswith("eval_") else
                                             f"eval/{key[5:]}", value, step)
        if self._bar is not None and "loss" in record:
            self._bar.set_postfix(bar_postfix(record), refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def bar_postfix(record: dict[str, float]) -> dict[str, str]:
    """The progress bar's postfix of a training record: loss and the speed fields it has."""
    out = {"loss": f"{record['loss']:.4f}"}
    for key, short, fmt in (("tokens_per_second", "tok/s", "{:.4g}"), ("mfu", "mfu", "{:.2%}"),
                            ("peak_memory_gb", "mem", "{:.2f}GB")):
        if record.get(key) is not None:  # null: not computable for this model (roll.perf warned once)
            out[short] = fmt.format(record[key])
    return out


def speed_meter(model_config, training, device, world_size: int) -> SpeedMeter:
    """roll.perf's meter for a Megatron model: FLOPs from the HF config the McaModelConfig carries
    (``hf_config``), or, for a config built without one, from its Megatron fields under HF names."""
    fields = dict(model_config.hf_config) if model_config.hf_config else hf_fields(model_config)
    if getattr(model_config, "reward_head", False):
        fields = reward.flops_fields(fields)
    return SpeedMeter(fields, world_size, device, training_dtype(training.bf16, training.fp16))


def hf_fields(config) -> dict:
    """The HF config fields ``roll.perf.flops_per_token`` reads, from a Megatron TransformerConfig."""
    return {"hidden_size": config.hidden_size, "intermediate_size": config.ffn_hidden_size,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_query_groups or config.num_attention_heads,
            "head_dim": config.kv_channels, "vocab_size": config.vocab_size,
            "num_experts": config.num_moe_experts, "num_experts_per_tok": config.moe_router_topk,
            "moe_intermediate_size": config.moe_ffn_hidden_size,
            "shared_expert_intermediate_size": config.moe_shared_expert_intermediate_size}


def _tensorboard_writer(log_dir: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        warn_once(logger, "report_to: tensorboard needs the tensorboard package (pip install tensorboard); "
                          "logging to train_log.jsonl only.")
        return None
    return SummaryWriter(log_dir=log_dir)
