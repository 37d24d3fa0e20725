"""Llama in Flax NNX with FP4 dense layers (see fp4jax/nn/rules.py for the module paths)."""

from fp4jax.nn.llama.config import PRESETS, Llama3RopeScaling, LlamaConfig
from fp4jax.nn.llama.model import Llama
