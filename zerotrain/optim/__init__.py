"""Optimizers that are more than one torch.optim class: --optimizer muon (Muon on the blocks' matrices, AdamW on the
rest: muon.py)."""
