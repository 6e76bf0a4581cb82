"""Peak host memory of a checkpoint conversion, from a model's shape (the planner's arithmetic).

One process converting at TP1/PP1 holds the whole model once, in the Megatron dtype; on top of it
(``backends/mca/models/loader.py``, ``export.py``):

- HF -> Megatron (``roll-convert hf2mca``, and ``roll-train --use-mca`` loading HF weights): the HF
  inputs of the one mapping being converted. A parameter a rank holds whole is filled in place: at the
  parameter's dtype read straight into it (a 1:1 rename, and at TP1 q/k/v and gate/up into the slices of
  the fused parameter), at another dtype through one input tensor at a time (the embedding is the
  largest); under TP a fused q/k/v or gate/up needs its inputs plus the fused result, the bound below. The Megatron checkpoint is written from the
  parameters themselves (PyTorch's FileSystemWriter threads: no staging copy).
- Megatron -> HF (``roll-convert mca2hf``): every tensor is read straight into the model (at another layout
  too, where its part lands in contiguous runs: TP shards of every dimension) and the gate/up halves merge
  into the parameter itself (``backends/mca/checkpoint_io.py``); a tensor that does not fit that (a padded
  vocabulary resized between layouts) is staged by PyTorch's reader before it is copied in (the embedding is
  the largest, the bound below). The HF file being assembled (at most ``--max-shard-gb``) holds copies of the split q/k/v
  tensors and references to the rest.

Ranks of a parallel layout hold their share of the weights instead of all of them; the extra terms stay.
"""

from __future__ import annotations

from dataclasses import dataclass

from roll.plan.shape import ModelShape


@dataclass(frozen=True)
class ConversionMemory:
    weights: int
    """The model once, in the Megatron dtype."""
    hf2mca_extra: int
    """Largest transient of the HF -> Megatron load on top of ``weights``."""
    mca2hf_extra: int
    """Largest transient of the Megatron -> HF export on top of ``weights`` (one HF shard included)."""

    @property
    def hf2mca(self) -> int:
        return self.weights + self.hf2mca_extra

    @property
    def mca2hf(self) -> int:
        return self.weights + self.mca2hf_extra


def conversion_memory(shape: ModelShape, hf_bytes: int = 2, megatron_bytes: int = 4,
                      max_shard_bytes: int = 2 * 1024**3) -> ConversionMemory:
    """Peak bytes of a one-process conversion of ``shape`` (dense models: the q/k/v and gate/up fusions).

    ``hf_bytes``/``megatron_bytes``: bytes per element of the HF checkpoint and of the Megatron model
    (``roll-convert`` builds it in fp32; ``roll-train --use-mca --bf16`` in bf16).
    """
    h, d, f, v = shape.hidden_size, shape.head_dim, shape.intermediate_size, shape.vocab_size
    qkv = h * (shape.num_heads + 2 * shape.num_kv_heads) * d
    gate_up = 2 * f * h
    fused = max(qkv, gate_up) * (hf_bytes + hf_bytes)  # the inputs, then their concatenation
    cast = v * h * hf_bytes if hf_bytes != megatron_bytes else 0  # a renamed tensor read at another dtype
    weights = shape.total_params() * megatron_bytes
    largest = v * h * megatron_bytes  # the embedding, staged by PyTorch's reader when loading at another layout
    return ConversionMemory(weights=weights, hf2mca_extra=max(fused, cast),
                            mca2hf_extra=max(largest, (qkv + gate_up) * megatron_bytes) + max_shard_bytes)


def conversion_memory_line(name: str = "qwen2.5-7b") -> str:
    """One sentence for ``roll-convert --help`` and the docs: the peaks of a known shape."""
    from roll.plan.shape import KNOWN_SHAPES

    shape = KNOWN_SHAPES[name]
    fp32 = conversion_memory(shape)
    online = conversion_memory(shape, megatron_bytes=2)
    params = shape.total_params() / 1e9
    return (f"Peak memory at most, one process ({name}, {params:.2f}B parameters, bf16 safetensors): "
            f"hf2mca {fp32.hf2mca / 1e9:.1f} GB (the fp32 model {fp32.weights / 1e9:.1f} GB + "
            f"{fp32.hf2mca_extra / 1e9:.1f} GB), mca2hf {fp32.mca2hf / 1e9:.1f} GB (+ {fp32.mca2hf_extra / 1e9:.1f} "
            f"GB with the default 2 GiB shards); roll-train --use-mca --bf16 loading it: "
            f"{online.hf2mca / 1e9:.1f} GB (the model + {online.hf2mca_extra / 1e9:.2f} GB). "
            "Never the whole model twice: HF shards are read tensor by tensor.")
