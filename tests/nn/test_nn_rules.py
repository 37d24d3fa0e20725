"""RouteRules: first full match wins, parsing, validation, the standard preset."""

import dataclasses

import pytest

from fp4jax import route as route_lib
from fp4jax.nn import RouteRules


def _names(rules, paths):
  return [rules.resolve(p).name for p in paths]


def test_first_full_match_wins_else_default():
  rules = RouteRules((("lm_head", "bf16"), (r"layers\.1\..*", "nvfp4"), (r"layers\.\d+\.mlp\..*", "mxfp4")),
                     default="mxfp4_rtn")
  paths = ["lm_head", "layers.1.mlp.up", "layers.0.mlp.up", "layers.10.mlp.up", "layers.10.attn.q",
           "x.lm_head"]
  # layers.10 is not matched by "layers\.1\..*" (full match on dotted paths), lm_head only in full.
  assert _names(rules, paths) == ["bf16", "nvfp4", "mxfp4", "mxfp4", "mxfp4_rtn", "mxfp4_rtn"]
  assert rules.resolve("lm_head") is route_lib.get("bf16")


def test_parse_and_hashable():
  rules = RouteRules.parse(["lm_head=bf16", r"layers\.(0|1)\..*=bf16", ".*=mxfp4"])
  assert rules.rules == (("lm_head", "bf16"), (r"layers\.(0|1)\..*", "bf16"), (".*", "mxfp4"))
  assert _names(rules, ["layers.0.attn.q", "layers.2.attn.q", "lm_head"]) == ["bf16", "mxfp4", "bf16"]
  assert hash(rules) == hash(RouteRules.parse(["lm_head=bf16", r"layers\.(0|1)\..*=bf16", ".*=mxfp4"]))
  # The split is at the last "=": a regex may contain one.
  assert RouteRules.parse(["a=b=nvfp4"]).rules == (("a=b", "nvfp4"),)


@pytest.mark.parametrize("specs, error, match", [
    (["lm_head"], ValueError, r"'lm_head' must read 'REGEX=ROUTE'"),
    (["=bf16"], ValueError, r"'=bf16' must read 'REGEX=ROUTE'"),
    (["lm_head="], ValueError, r"'lm_head=' must read 'REGEX=ROUTE'"),
    (["lm_head=fp3"], ValueError, r"unknown route 'fp3'"),
    (["layers\\.(0=bf16"], ValueError, r"route rule 'layers\\\\.\(0'='bf16': bad regex"),
    ("lm_head=bf16", TypeError, r"sequence of 'REGEX=ROUTE' strings"),
])
def test_parse_errors_are_clear(specs, error, match):
  with pytest.raises(error, match=match):
    RouteRules.parse(specs)


def test_unknown_default_route():
  with pytest.raises(ValueError, match="unknown route 'fp6'"):
    RouteRules((), default="fp6")


def test_standard_preset():
  rules = RouteRules.standard("nvfp4", n_layers=6, bf16_first=1, bf16_last=2)
  blocks = [rules.resolve(f"layers.{i}.{m}").name for i in range(6) for m in ("attn.q", "mlp.down")]
  assert blocks == ["bf16"] * 2 + ["nvfp4"] * 6 + ["bf16"] * 4
  assert rules.resolve("lm_head").name == "bf16"
  assert rules.resolve("embed").name == "bf16"  # Not a linear; anything unnamed stays high precision.
  assert RouteRules.standard("mxfp4", n_layers=2).resolve("layers.1.attn.o").name == "mxfp4"
  with pytest.raises(ValueError, match="bf16_first=2 and bf16_last=1 .* n_layers=2"):
    RouteRules.standard("mxfp4", n_layers=2, bf16_first=2, bf16_last=1)


def test_standard_rules_refuse_a_model_of_another_depth():
  """"The last 2 blocks in bf16" made for 16 blocks would put none of a 6-block model's blocks in bf16."""
  rules = RouteRules.standard("nvfp4", n_layers=16, bf16_last=2)
  rules.check_depth(16)
  with pytest.raises(ValueError, match=r"made for 16 blocks .* given a model of 6 blocks: make them with n_layers=6"):
    rules.check_depth(6)
  with pytest.raises(ValueError, match="made for 16 blocks"):  # the user's rules put in front keep the depth
    dataclasses.replace(rules, rules=RouteRules.parse(["lm_head=mxfp4"]).rules).check_depth(6)
  RouteRules.parse([r"layers\.0\..*=bf16"]).check_depth(6)  # rules by regex alone fit any depth
  with pytest.raises(TypeError, match="n_layers takes an int >= 0 or None, got 2.0"):
    RouteRules((), n_layers=2.0)


def test_attention_and_mlp_are_distinguishable():
  rules = RouteRules.parse([r"layers\.\d+\.attn\..*=bf16", r"layers\.\d+\.mlp\..*=mxfp4"])
  assert _names(rules, ["layers.3.attn.v", "layers.3.mlp.gate"]) == ["bf16", "mxfp4"]


def test_routes_may_be_route_objects():
  """A Route (a custom one, say) is kept as given, as fp4_dot and FP4Linear take it; resolve returns it."""
  nvfp4 = route_lib.get("nvfp4")
  custom = dataclasses.replace(nvfp4, name="my_nvfp4")
  rules = RouteRules((("lm_head", custom), (r"layers\..*", "mxfp4")), default=nvfp4)
  assert rules.resolve("lm_head") is custom and rules.resolve("layers.0.attn.q").name == "mxfp4"
  assert rules.resolve("embed") is nvfp4
  assert hash(rules) == hash(RouteRules((("lm_head", custom), (r"layers\..*", "mxfp4")), default=nvfp4))
  assert RouteRules.standard(custom, n_layers=2).resolve("layers.1.mlp.up") is custom
  assert RouteRules.parse(["lm_head=bf16"], default=custom).resolve("x") is custom


@pytest.mark.parametrize("rules, error, match", [
    (("lm_head", "nvfp4"), TypeError, r"\(regex, route\) pairs .* got 'lm_head'"),  # one pair, not nested
    ("lm_head=nvfp4", TypeError, r"got the string 'lm_head=nvfp4': RouteRules.parse"),
    ({"lm_head": "nvfp4"}, TypeError, r"takes a tuple of \(regex, route\) pairs"),
    ((("lm_head", "nvfp4", "x"),), TypeError, r"\(regex, route\) pairs .* got \('lm_head', 'nvfp4', 'x'\)"),
    (((None, "bf16"),), TypeError, r"the regex must be a str, got NoneType"),
    (((" ", "bf16"),), ValueError, r"the regex is empty"),
    ((("lm_head", 4),), TypeError, r"route rule 'lm_head' takes a route name or an fp4jax.Route, got 4"),
    ((("lm_head", "fp3"),), ValueError, r"unknown route 'fp3'"),
])
def test_malformed_rules_are_rejected(rules, error, match):
  with pytest.raises(error, match=match):
    RouteRules(rules)


@pytest.mark.parametrize("specs, error, match", [
    ([" =nvfp4"], ValueError, r"' =nvfp4' must read 'REGEX=ROUTE'"),  # empty once stripped
    (["lm_head= "], ValueError, r"'lm_head= ' must read 'REGEX=ROUTE'"),
    ([("lm_head", "bf16")], TypeError, r"takes 'REGEX=ROUTE' strings, got \('lm_head', 'bf16'\)"),
    ([None], TypeError, r"takes 'REGEX=ROUTE' strings, got None"),
    (None, TypeError, r"sequence of 'REGEX=ROUTE' strings, got None"),
])
def test_malformed_specs_are_rejected(specs, error, match):
  with pytest.raises(error, match=match):
    RouteRules.parse(specs)
  with pytest.raises(TypeError, match="takes a dotted module path"):
    RouteRules.parse(["lm_head=bf16"]).resolve(3)


@pytest.mark.parametrize("kw, name", [({"bf16_first": 1.5}, "bf16_first"), ({"bf16_last": "1"}, "bf16_last"),
                                      ({"bf16_first": True}, "bf16_first"), ({"n_layers": 4.0}, "n_layers")])
def test_standard_takes_ints(kw, name):
  with pytest.raises(TypeError, match=f"standard's {name} takes an int"):
    RouteRules.standard("nvfp4", **{"n_layers": 4, **kw})


def test_unused_rules():
  """A rule is unused when its regex fully matches no path, or earlier rules take every path it matches."""
  paths = ["layers.0.attn.q", "layers.0.mlp.up", "layers.1.attn.q", "layers.1.mlp.up"]
  rules = RouteRules.parse([r"layer\.\d+\..*=mxfp4",  # misspelt: matches nothing
                            r"layers\.\d+\..*=nvfp4", r"layers\.1\..*=bf16",  # shadowed by the one before
                            r"layers\.0\.attn\.q=bf16",  # shadowed too
                            r"attn=bf16"])  # a full match is needed
  assert rules.unused(paths) == ((r"layer\.\d+\..*", "mxfp4"), (r"layers\.1\..*", "bf16"),
                                 (r"layers\.0\.attn\.q", "bf16"), ("attn", "bf16"))
  assert RouteRules.parse([r"layers\.0\..*=bf16", r"layers\.\d+\..*=nvfp4"]).unused(paths) == ()
  # The standard recipe's rules are fallback, never reported: lm_head=bf16 legitimately matches nothing here.
  std = RouteRules.standard("nvfp4", n_layers=2, bf16_first=1)
  assert std.rules == () and std.unused(paths) == ()
  combined = dataclasses.replace(std, rules=RouteRules.parse(["lm_head=mxfp4", r"layers\.1\.mlp\.up=mxfp4"]).rules)
  assert combined.unused(paths) == (("lm_head", "mxfp4"),)
  assert [combined.resolve(p).name for p in paths] == ["bf16", "bf16", "nvfp4", "mxfp4"]
  with pytest.raises(TypeError, match="list of module paths, got one string"):
    rules.unused("layers.0.attn.q")


def _llama(rules, **kw):
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from fp4jax.nn.llama import Llama, LlamaConfig  # pylint: disable=g-import-not-at-top
  config = LlamaConfig.preset("tiny", n_layers=2, dim=32, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=32, **kw)
  return Llama(config, rules=rules, rngs=nnx.Rngs(0))


def test_llama_rejects_a_rule_that_decides_no_linear():
  typo = RouteRules.parse([r"layer\.\d+\..*=mxfp4_rtn"])  # "layer" for "layers": would train all in bf16
  with pytest.raises(ValueError, match=r"route rules 'layer\\.\\d\+\\..\*=mxfp4_rtn' decide the route of no "
                                       r"linear.*'layers.0.attn.q'.*'lm_head'.* up to layers.1"):
    _llama(typo)
  with pytest.raises(ValueError, match=r"route rules 'lm_head=mxfp4' decide the route of no linear"):
    _llama(RouteRules.parse(["lm_head=mxfp4"]), tie_embeddings=True)  # a tied model has no lm_head linear
  # The standard recipe's lm_head=bf16 matches nothing in a tied model, and is fine; user rules in front too.
  std = RouteRules.standard("mxfp4_rtn", n_layers=2, bf16_last=1)
  model = _llama(dataclasses.replace(std, rules=((r"layers\.0\.mlp\..*", "nvfp4"),)), tie_embeddings=True)
  assert model.routes()["layers.0.mlp.up"] == "nvfp4" and model.routes()["layers.1.attn.q"] == "bf16"
