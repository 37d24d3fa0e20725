"""Each kernel body traced once per configuration: launches that differ only in their grid share its jaxpr.

`pl.pallas_call` traces its kernel at every launch, and a kernel body is hundreds of equations (an MS-EDEN
quantizer about 550): in quartet2's Llama-30M train step 24 launches traced 5 distinct bodies, 0.67 of its
2.26 s trace on a 2-CPU machine (docs/BENCHMARKS.md, "Session of 2026-12-07, 16:50 UTC"). The canonical
launches of `eden` and `amax` (`pallas.__init__`) differ only in their last grid extent, which their code does
not read (`common.grid_ids`). `launch` traces a body once per `body_key` and gives every later launch of that key
the same jaxpr inside its own launch parameters (grid, index maps, name), which a launch of an empty kernel
yields.

The key is what the body's jaxpr can depend on: the kernel (a function without closure cells, or a
`functools.partial` of one and the partial's arguments, nested partials and functions among them keyed alike), the
blocks its refs see (each BlockSpec but its index map, and the dtypes: a ref's aval), the launch's other
arguments but its name, whether x64 is on, and the mesh and operand shardings the launch is traced under
(`_context`). A kernel not of that form (a closure may hold anything) is traced at every launch, as before. The
dual-view kernels get x's shape only where they draw random bits (`common.draw_shape`), so that their
deterministic launches share a body too.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import types
from typing import Callable

import jax
import jax.extend

_MAX_BODIES = 256
_BODIES: collections.OrderedDict[tuple, object] = collections.OrderedDict()  # key -> kernel jaxpr, LRU
_LOCK = threading.Lock()  # programs may trace on several threads


def _spec_key(spec, arg) -> tuple:
  """A BlockSpec's fields but its index map, and the operand's dtype (and its shape where the spec takes the
  whole array: then the ref is the array)."""
  fields = tuple((f.name, getattr(spec, f.name)) for f in dataclasses.fields(spec) if f.name != "index_map")
  whole = getattr(spec, "block_shape", None) is None
  return fields, str(arg.dtype), tuple(arg.shape) if whole else None


class _Unkeyable(Exception):
  pass


def _value_key(value):
  """A partial's argument as a key: a callable by `_callable_key`, a tuple or list item by item, anything else
  with its type (1, 1.0 and True are equal in Python, not in a trace)."""
  if callable(value) and not isinstance(value, type):
    key = _callable_key(value)
    if key is None:
      raise _Unkeyable
    return key
  if isinstance(value, (tuple, list)):
    return type(value), tuple(map(_value_key, value))
  return type(value), value


def _callable_key(f) -> tuple | None:
  """A function without closure cells as itself; a `functools.partial` of one as its function and its
  arguments (keyed alike, so nested partials compare by what they hold); anything else (a closure, a jitted
  function, a bound method) None."""
  if isinstance(f, types.FunctionType):
    return ("function", f) if f.__closure__ is None else None
  if not isinstance(f, functools.partial):
    return None
  try:
    return ("partial", _callable_key(f.func), tuple(map(_value_key, f.args)),
            tuple(sorted((k, _value_key(v)) for k, v in f.keywords.items())))
  except _Unkeyable:
    return None


def _context(args) -> str:
  """The mesh the launch is traced under and its operands' shardings and manual axes, which its refs' avals
  carry (a body traced inside a `jax.shard_map` does not serve a launch outside one)."""
  avals = [jax.typeof(a) for a in args]
  return repr((jax.sharding.get_abstract_mesh(), [(a.sharding.spec, a.manual_axis_type) for a in avals]))


def body_key(kernel: Callable, in_specs, out_specs, args, out_shape, kwargs: dict) -> tuple | None:
  """What the jaxpr of `kernel` traced for this launch depends on (module docstring), or None where that
  cannot be told: then the launch traces its kernel itself."""
  kernel_key = _callable_key(kernel)
  if kernel_key is None:
    return None
  flat = lambda specs: list(specs) if isinstance(specs, (list, tuple)) else [specs]
  outs = jax.tree.leaves(out_shape)
  in_list, out_list = flat(in_specs), flat(out_specs)
  if len(in_list) != len(args) or len(out_list) != len(outs):
    return None
  try:
    key = (kernel_key,
           tuple(_spec_key(s, a) for s, a in zip(in_list, args)),
           tuple(_spec_key(s, o) for s, o in zip(out_list, outs)),
           tuple(sorted((k, _value_key(v)) for k, v in kwargs.items() if k != "name")),
           bool(jax.config.jax_enable_x64), _context(args))
    hash(key)
  except (_Unkeyable, TypeError):
    return None
  return key


def _empty_kernel(*refs) -> None:
  """The kernel of a launch whose body was traced before: its trace holds the launch's parameters alone."""
  del refs


def launch(make: Callable[[Callable], Callable], kernel: Callable, key: tuple | None, *args):
  """`make(kernel)(*args)` (`make` builds the `pl.pallas_call` of a kernel), with the kernel body traced only
  at the first launch of `key` (None: at every launch)."""
  if key is None:
    return make(kernel)(*args)
  with _LOCK:
    body = _BODIES.get(key)
    if body is not None:
      _BODIES.move_to_end(key)
  closed, shapes = jax.make_jaxpr(make(kernel if body is None else _empty_kernel), return_shape=True)(*args)
  [eqn] = [e for e in closed.jaxpr.eqns if e.primitive.name == "pallas_call"]
  if body is None:
    with _LOCK:
      _BODIES[key] = eqn.params["jaxpr"]
      if len(_BODIES) > _MAX_BODIES:
        _BODIES.popitem(last=False)
  else:
    params = dict(eqn.params, jaxpr=body.replace(debug_info=eqn.params["jaxpr"].debug_info))  # its own name
    closed = closed.replace(jaxpr=closed.jaxpr.replace(
        eqns=[e.replace(params=params) if e is eqn else e for e in closed.jaxpr.eqns]))
  return jax.tree.unflatten(jax.tree.structure(shapes), jax.extend.core.jaxpr_as_fun(closed)(*args))
