"""Training entrypoint package: ``python -m train --config configs/quickstart.py``."""
