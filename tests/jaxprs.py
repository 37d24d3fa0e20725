"""Reading traced programs in tests: how often a primitive is bound, nested jaxprs (jitted functions, scans,
custom derivatives) included."""


def primitive_count(jaxpr, name: str) -> int:
  """How many times `jaxpr` binds the primitive `name`, each call of a nested jaxpr counted."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == name
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
          count += primitive_count(getattr(sub, "jaxpr", sub), name)
  return count
