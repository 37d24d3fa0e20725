"""fp4jax pretraining loop: `python -m train --config configs/cpu_compare.yaml [--set key=value ...]`."""
