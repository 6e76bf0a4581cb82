"""roll: one YAML recipe, two interchangeable training backends (Megatron-Core and HF/DeepSpeed)."""

__version__ = "0.1.0"

IGNORE_INDEX = -100
"""The one label value that marks a token as not trained on (prompt, padding, first position)."""
