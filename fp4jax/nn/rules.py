"""Route rules: which numeric route each linear layer of a model uses, chosen by its module path.

Paths are the dotted NNX attribute paths of the FP4Linear modules. In `fp4jax.nn.llama.Llama`:
  layers.{i}.attn.{q,k,v,o}      attention projections of block i (0-based)
  layers.{i}.mlp.{gate,up,down}  SwiGLU MLP of block i
  lm_head                        output projection (absent when embeddings are tied)
The token embedding is an `nnx.Embed` (a gather, no GEMM) and takes no route; a tied lm_head is
`embed.attend`, always bf16.

A rule is (regex, route), the route a preset name or a `Route`; the first regex that *fully* matches the path
wins, else `default`. The user's `rules` come first and must each decide some path (`unused`: a misspelt regex
would otherwise leave every layer on `default` without a word); `fallback` rules, a recipe's generic ones
(`standard`), follow and may decide none (lm_head=bf16 in a model whose lm_head is tied).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence

from fp4jax import route as route_lib
from fp4jax.route import Route

Rule = tuple[str, str | Route]


class UnusedRulesError(ValueError):
  """A model's user rules include some that decide the route of none of its linears (`RouteRules.unused`)."""


def _route(route: str | Route, what: str) -> str | Route:
  """`route` as given once it names a preset or is a Route (a TypeError / the known names otherwise)."""
  if not isinstance(route, (str, Route)):
    raise TypeError(f"{what} takes a route name or an fp4jax.Route, got {route!r}")
  route_lib.get(route)  # Fails with the known names.
  return route


def _rules(rules: Sequence[Rule], field: str) -> tuple[Rule, ...]:
  """`rules` as a tuple of (regex, route) pairs, each checked: a str regex that compiles, a known route."""
  if isinstance(rules, str):
    raise TypeError(f"RouteRules' {field} takes (regex, route) pairs, got the string {rules!r}: "
                    f"RouteRules.parse reads 'REGEX=ROUTE' strings")
  if not isinstance(rules, Sequence):
    raise TypeError(f"RouteRules' {field} takes a tuple of (regex, route) pairs such as (('lm_head', 'bf16'),), "
                    f"got {rules!r}")
  out = []
  for rule in rules:
    if isinstance(rule, str) or not isinstance(rule, Sequence) or len(rule) != 2:
      raise TypeError(f"RouteRules' {field} takes (regex, route) pairs such as ('lm_head', 'bf16'), got {rule!r}")
    pattern, route = rule
    if not isinstance(pattern, str):
      raise TypeError(f"route rule {rule!r}: the regex must be a str, got {type(pattern).__name__}")
    if not pattern.strip():
      raise ValueError(f"route rule {rule!r}: the regex is empty; it would match no module path")
    try:
      re.compile(pattern)
    except re.error as e:
      raise ValueError(f"route rule {pattern!r}={route!r}: bad regex: {e}") from None
    out.append((pattern, _route(route, f"route rule {pattern!r}")))
  return tuple(out)


def describe(rule: Rule) -> str:
  """'REGEX=ROUTE' of `rule` (a Route by its name), for messages."""
  pattern, route = rule
  return f"{pattern}={route.name if isinstance(route, Route) else route}"


@dataclasses.dataclass(frozen=True)
class RouteRules:
  """Ordered (regex, route) rules; `resolve(path)` gives the route of the first full match.

  `rules`: the user's, tried first; a model rejects one that decides no layer's route (`unused`).
  `default`: the route of a path no rule matches. `fallback`: rules tried after `rules` that may decide no
  path, a recipe's generic ones (`standard`). Routes are preset names or `Route` objects, kept as given.
  `n_layers`: the model depth the rules were made for (`standard`: its last blocks are counted from it), which
  a model of another depth refuses (`check_depth`); None for rules that fit any depth.
  """

  rules: tuple[Rule, ...]
  default: str | Route = "bf16"
  fallback: tuple[Rule, ...] = ()
  n_layers: int | None = None

  def __post_init__(self):
    object.__setattr__(self, "rules", _rules(self.rules, "rules"))
    object.__setattr__(self, "fallback", _rules(self.fallback, "fallback"))
    _route(self.default, "RouteRules' default")
    if self.n_layers is not None and (not isinstance(self.n_layers, int) or isinstance(self.n_layers, bool)
                                      or self.n_layers < 0):
      raise TypeError(f"RouteRules' n_layers takes an int >= 0 or None, got {self.n_layers!r}")

  def check_depth(self, n_layers: int) -> None:
    """A ValueError if the rules were made for a model of other than `n_layers` blocks: "the last 2 blocks in
    bf16" made for 16 blocks would put blocks 14 and 15 in bf16, none of a 6-block model's."""
    if self.n_layers is not None and self.n_layers != n_layers:
      raise ValueError(f"route rules made for {self.n_layers} blocks (RouteRules.standard(n_layers="
                       f"{self.n_layers})) given a model of {n_layers} blocks: make them with n_layers={n_layers}")

  def _decider(self, path: str) -> int | None:
    """Index in rules + fallback of the first rule whose regex fully matches `path`; None if none does."""
    for i, (pattern, _) in enumerate(self.rules + self.fallback):
      if re.fullmatch(pattern, path):
        return i
    return None

  def resolve(self, path: str) -> Route:
    """The route of the module at dotted `path`: the first rule whose regex fully matches, else default."""
    if not isinstance(path, str):
      raise TypeError(f"RouteRules.resolve takes a dotted module path (a str, e.g. 'layers.0.attn.q'), got {path!r}")
    i = self._decider(path)
    return route_lib.get(self.default if i is None else (self.rules + self.fallback)[i][1])

  def unused(self, paths: Iterable[str]) -> tuple[Rule, ...]:
    """The `rules` (not `fallback`) that decide the route of none of `paths`: their regex fully matches none
    of them, or earlier rules take every path it matches. A model's linear paths leave a misspelt rule here."""
    if isinstance(paths, str):
      raise TypeError(f"RouteRules.unused takes a list of module paths, got one string {paths!r}")
    decided = {self._decider(p) for p in paths}
    return tuple(rule for i, rule in enumerate(self.rules) if i not in decided)

  @classmethod
  def parse(cls, specs: Sequence[str], default: str | Route = "bf16") -> RouteRules:
    """Rules from strings "REGEX=ROUTE", e.g. ["lm_head=bf16", r"layers\\.(0|1)\\..*=bf16", ".*=mxfp4"].

    The split is at the last "=", so a regex may itself contain "=" (route names never do).
    """
    if isinstance(specs, str) or not isinstance(specs, Sequence):
      raise TypeError(f"RouteRules.parse takes a sequence of 'REGEX=ROUTE' strings, got {specs!r}")
    rules = []
    for spec in specs:
      if not isinstance(spec, str):
        raise TypeError(f"RouteRules.parse takes 'REGEX=ROUTE' strings, got {spec!r}; RouteRules(rules) takes "
                        f"(regex, route) pairs")
      pattern, sep, name = spec.rpartition("=")
      pattern, name = pattern.strip(), name.strip()
      if not sep or not pattern or not name:
        raise ValueError(f"route rule {spec!r} must read 'REGEX=ROUTE', e.g. 'layers\\.0\\..*=bf16'")
      rules.append((pattern, name))
    return cls(tuple(rules), default)

  @classmethod
  def standard(cls, route: str | Route, *, n_layers: int, bf16_first: int = 0, bf16_last: int = 0) -> RouteRules:
    """The usual recipe: every block linear on `route` except the first/last N blocks; the rest bf16.

    The embedding and lm_head stay bf16 (every FP4 pretraining reference keeps them high precision). All of
    it is `fallback`: put your own rules in front with `dataclasses.replace(rules, rules=...)`. `n_layers` is
    the depth of the model the rules are for: a model of another depth refuses them (`check_depth`).
    """
    for name, value in (("n_layers", n_layers), ("bf16_first", bf16_first), ("bf16_last", bf16_last)):
      if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"RouteRules.standard's {name} takes an int, got {value!r}")
    if bf16_first < 0 or bf16_last < 0 or bf16_first + bf16_last > n_layers:
      raise ValueError(f"{bf16_first=} and {bf16_last=} must be >= 0 and sum to at most {n_layers=}")
    high = sorted(set(range(bf16_first)) | set(range(n_layers - bf16_last, n_layers)))
    rules = [("lm_head", "bf16")]
    if high:
      rules.append((rf"layers\.({'|'.join(map(str, high))})\..*", "bf16"))
    rules.append((r"layers\.\d+\..*", route))
    return cls((), default="bf16", fallback=tuple(rules), n_layers=n_layers)
