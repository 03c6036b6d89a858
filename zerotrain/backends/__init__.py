"""Training backends: DeepSpeed (preferred) and PyTorch FSDP2 (fallback)."""
