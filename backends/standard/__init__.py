"""The standard backend: Hugging Face Trainer / TRL, optionally with DeepSpeed ZeRO."""

from backends.standard.backend import StandardBackend

__all__ = ["StandardBackend"]
