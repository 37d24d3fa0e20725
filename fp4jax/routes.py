"""`fp4jax.routes`: the numeric routes by name (`names()`, `get(name)`); definitions live in `fp4jax.route`."""

from fp4jax.route import OperandSpec, Route, get, names

__all__ = ["OperandSpec", "Route", "get", "names"]
