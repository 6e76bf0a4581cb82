"""The vision tower of a Qwen-VL model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), read from ``vision_config`` for ``--plan``.

Parameters exactly (checked against transformers' own modules in tests/unit/test_plan.py), activations roughly
(docs/planner.md). The three families differ in the MLP (Qwen2.5-VL: gated SiLU with biases; Qwen2-VL and
Qwen3-VL: two matrices with biases), the norms (RMSNorm without bias in Qwen2.5-VL, LayerNorm with bias in the
others), a learned position table and the deepstack mergers (Qwen3-VL).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VisionShape:
    """The numbers of a Qwen-VL vision tower that decide its parameters and activations."""

    depth: int
    hidden_size: int  # the blocks' width (Qwen2-VL: embed_dim)
    intermediate_size: int  # the blocks' MLP width (Qwen2-VL: embed_dim * mlp_ratio)
    out_hidden_size: int  # the merger's output: the language model's hidden size
    patch_inputs: int  # in_channels * temporal_patch_size * patch_size ** 2 (1176)
    merge: int = 2  # spatial_merge_size: merge x merge patches become one language-model token
    gated_mlp: bool = True
    norm_bias: bool = False  # LayerNorm (weight + bias) instead of RMSNorm (weight)
    patch_bias: bool = False
    position_table: int = 0  # Qwen3-VL: num_position_embeddings learned positions
    deepstack_mergers: int = 0  # Qwen3-VL: extra mergers feeding these blocks' features to the language model

    def _norm(self, width: int) -> int:
        return width * (2 if self.norm_bias else 1)

    def block_params(self) -> int:
        h, ffn = self.hidden_size, self.intermediate_size
        attention = h * 3 * h + 3 * h + h * h + h
        mlp = (3 if self.gated_mlp else 2) * h * ffn + (2 if self.gated_mlp else 1) * ffn + h
        return 2 * self._norm(h) + attention + mlp

    def _merger_params(self, postshuffle_norm: bool) -> int:
        wide = self.hidden_size * self.merge ** 2
        norm = self._norm(wide if postshuffle_norm else self.hidden_size)
        return norm + wide * wide + wide + wide * self.out_hidden_size + self.out_hidden_size

    def merger_params(self) -> int:
        """``visual.merger`` (what freeze_multi_modal_projector freezes)."""
        return self._merger_params(postshuffle_norm=False)

    def tower_params(self) -> int:
        """``visual`` but its merger (what freeze_vision_tower freezes; Qwen3-VL's deepstack mergers with it)."""
        patch = self.patch_inputs * self.hidden_size + (self.hidden_size if self.patch_bias else 0)
        return patch + self.depth * self.block_params() + self.position_table * self.hidden_size \
            + self.deepstack_mergers * self._merger_params(postshuffle_norm=True)

    def total_params(self) -> int:
        return self.tower_params() + self.merger_params()

    def activation_bytes(self, patches: float, act_bytes: int, train_tower: bool, train_merger: bool,
                         recompute: bool) -> float:
        """What backward keeps for ``patches`` patches: nothing when tower and merger are frozen (no gradient
        reaches them); a trained tower, per block Korthikanti's 34 * s * h (16-bit, attention fused; each block's
        input only, 2 * s * h, under full recompute) and about 4 * s * h per deepstack merger; a trained merger
        about 4 * s * h."""
        scale = act_bytes / 2
        s, h = patches, self.hidden_size
        merger = 4 * s * h * scale if (train_merger or train_tower) else 0.0
        if not train_tower:
            return merger
        per_block = (2 if recompute else 34) * s * h * scale
        deepstack = self.deepstack_mergers * 4 * s * h * scale  # Qwen3-VL: each a merger, trained with the tower
        return self.depth * per_block + (34 * s * h * scale if recompute else 0.0) + merger + deepstack

    def deepstack_bytes(self, tokens: float, act_bytes: int) -> float:
        """Qwen3-VL's deepstack features of ``tokens`` image tokens: one ``out_hidden_size`` vector per token and
        deepstack merger (the language model's first layers add them to their output)."""
        return self.deepstack_mergers * tokens * self.out_hidden_size * act_bytes


def vision_shape(config: dict) -> VisionShape | None:
    """The VisionShape of a config.json dict with a ``vision_config`` (None without one)."""
    vision = config.get("vision_config") if isinstance(config, dict) else None
    if not isinstance(vision, dict):
        return None
    family = str(config.get("model_type", ""))
    patch = int(vision.get("patch_size", vision.get("spatial_patch_size", 14)))
    inputs = int(vision.get("in_channels", vision.get("in_chans", 3))) * int(vision.get("temporal_patch_size", 2)) \
        * patch ** 2
    merge = int(vision.get("spatial_merge_size", 2))
    if family == "qwen2_vl":  # embed_dim wide blocks, hidden_size is the merger's output
        width = int(vision.get("embed_dim", 1280))
        return VisionShape(int(vision.get("depth", 32)), width, int(width * vision.get("mlp_ratio", 4)),
                           int(vision.get("hidden_size", 3584)), inputs, merge, gated_mlp=False, norm_bias=True)
    qwen3 = family.startswith("qwen3")
    return VisionShape(int(vision["depth"]), int(vision["hidden_size"]), int(vision["intermediate_size"]),
                       int(vision["out_hidden_size"]), inputs, merge, gated_mlp=not qwen3, norm_bias=qwen3,
                       patch_bias=qwen3, position_table=int(vision.get("num_position_embeddings", 0)) if qwen3 else 0,
                       deepstack_mergers=len(vision.get("deepstack_visual_indexes") or ()) if qwen3 else 0)
