"""Megatron models from HF checkpoints and back: config, family templates, sharding, AutoModel, export.

Importing a submodule imports megatron; ``backends.mca`` itself never imports this package eagerly.
"""
