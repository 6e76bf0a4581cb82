"""LoRA on Megatron-Core: tensor-parallel adapters, PEFT-identical init, HF PEFT export (docs/mca-lora.md)."""
