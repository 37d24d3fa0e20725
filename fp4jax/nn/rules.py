"""Route rules: which numeric route each linear layer of a model uses, chosen by its module path.

Paths are the dotted NNX attribute paths of the FP4Linear modules. In `fp4jax.nn.llama.Llama`:
  layers.{i}.attn.{q,k,v,o}      attention projections of block i (0-based)
  layers.{i}.mlp.{gate,up,down}  SwiGLU MLP of block i
  lm_head                        output projection (absent when embeddings are tied)
The token embedding is an `nnx.Embed` (a gather, no GEMM) and takes no route; a tied lm_head is
`embed.attend`, always bf16.

A rule is (regex, route name); the first regex that *fully* matches the path wins, else `default`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

from fp4jax import route as route_lib
from fp4jax.route import Route


@dataclasses.dataclass(frozen=True)
class RouteRules:
  """Ordered (regex, route name) rules; `resolve(path)` gives the route of the first full match."""

  rules: tuple[tuple[str, str], ...]
  default: str = "bf16"

  def __post_init__(self):
    object.__setattr__(self, "rules", tuple((str(p), str(r)) for p, r in self.rules))
    for pattern, name in self.rules:
      try:
        re.compile(pattern)
      except re.error as e:
        raise ValueError(f"route rule {pattern!r}={name!r}: bad regex: {e}") from None
      route_lib.get(name)  # Fails with the known names.
    route_lib.get(self.default)

  def resolve(self, path: str) -> Route:
    """The route of the module at dotted `path`: the first rule whose regex fully matches, else default."""
    for pattern, name in self.rules:
      if re.fullmatch(pattern, path):
        return route_lib.get(name)
    return route_lib.get(self.default)

  @classmethod
  def parse(cls, specs: Sequence[str], default: str = "bf16") -> RouteRules:
    """Rules from strings "REGEX=ROUTE", e.g. ["lm_head=bf16", r"layers\\.(0|1)\\..*=bf16", ".*=mxfp4"].

    The split is at the last "=", so a regex may itself contain "=" (route names never do).
    """
    if isinstance(specs, str):
      raise TypeError(f"RouteRules.parse takes a sequence of 'REGEX=ROUTE' strings, got one string {specs!r}")
    rules = []
    for spec in specs:
      pattern, sep, name = spec.rpartition("=")
      if not sep or not pattern or not name:
        raise ValueError(f"route rule {spec!r} must read 'REGEX=ROUTE', e.g. 'layers\\.0\\..*=bf16'")
      rules.append((pattern.strip(), name.strip()))
    return cls(tuple(rules), default)

  @classmethod
  def standard(cls, route: str, *, n_layers: int, bf16_first: int = 0, bf16_last: int = 0) -> RouteRules:
    """The usual recipe: every block linear on `route` except the first/last N blocks; the rest bf16.

    The embedding and lm_head stay bf16 (every FP4 pretraining reference keeps them high precision).
    """
    if bf16_first < 0 or bf16_last < 0 or bf16_first + bf16_last > n_layers:
      raise ValueError(f"{bf16_first=} and {bf16_last=} must be >= 0 and sum to at most {n_layers=}")
    high = sorted(set(range(bf16_first)) | set(range(n_layers - bf16_last, n_layers)))
    rules = [("lm_head", "bf16")]
    if high:
      rules.append((rf"layers\.({'|'.join(map(str, high))})\..*", "bf16"))
    rules.append((r"layers\.\d+\..*", route))
    return cls(tuple(rules), default="bf16")
