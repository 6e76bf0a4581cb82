"""The Megatron-Core training loop, split by phase.

- ``data``: the shared sample order sharded over data-parallel ranks, micro-batches shaped for the
  layout (packing, context parallelism, one length per step under pipeline parallelism);
- ``loss``: the per-token loss from vocab-parallel logits with padded vocabulary rows masked;
- ``optim``: DDP wrapping, the Megatron optimizer from the recipe's HF keys, the LR schedule;
- ``checkpointing``: ``checkpoint-N/`` (model, optimizer, scheduler, RNG, trainer state), resume;
- ``metrics``: progress bar, ``train_log.jsonl``, TensorBoard;
- ``loop``: ``MegatronTrainer``, which ties them together (train / evaluate).

Importing this package imports megatron-core; the backend imports it lazily.
"""
