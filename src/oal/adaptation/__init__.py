"""Joint LoRA + kernel adaptation (paper App. F.2): settings (`config`), the resumable data-parallel training loop
(`train`), its checkpoints (`checkpoint`) and the saved adapter (`adapter`)."""
