"""Sparse row-wise optimizers against dense references of the same rules."""
