"""Reading traced programs in tests: every equation a program binds, nested jaxprs (jitted functions, scans,
conds, custom derivatives, Pallas kernel bodies) included."""

from typing import Iterator


def equations(jaxpr, *, into_kernels: bool = True) -> Iterator:
  """Every equation of `jaxpr` and of the jaxprs in its equations' parameters, a nested jaxpr's equations once
  per equation that calls it (a jitted function called twice is listed twice). `into_kernels=False` lists a
  `pallas_call` without its kernel body."""
  for eqn in jaxpr.eqns:
    yield eqn
    if eqn.primitive.name == "pallas_call" and not into_kernels:
      continue
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
        if hasattr(sub, "eqns"):
          yield from equations(sub, into_kernels=into_kernels)


def primitive_count(jaxpr, name: str) -> int:
  """How many times `jaxpr` binds the primitive `name`, each call of a nested jaxpr counted."""
  return sum(eqn.primitive.name == name for eqn in equations(jaxpr))
