"""Flax NNX layers on fp4_dot: FP4Linear, a dot_general hook for nnx.Linear, route rules by module path."""

from fp4jax.nn.linear import FP4Linear, fp4_dot_general
from fp4jax.nn.rules import RouteRules
