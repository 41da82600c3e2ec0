"""What models are built from, below them: tensor-parallel rules (sharding), the LoRA
update beside each projection (lora), the batch-invariant ops and dense attention."""
