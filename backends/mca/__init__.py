"""The mca backend: Megatron-Core models converted on the fly from (and back to) HF checkpoints.

Importing this package must stay cheap and must not import megatron: config validation loads the
backend class to ask what it supports.
"""

from backends.mca.backend import McaBackend

__all__ = ["McaBackend"]
