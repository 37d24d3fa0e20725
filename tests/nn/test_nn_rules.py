"""RouteRules: first full match wins, parsing, validation, the standard preset."""

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


def test_attention_and_mlp_are_distinguishable():
  rules = RouteRules.parse([r"layers\.\d+\.attn\..*=bf16", r"layers\.\d+\.mlp\..*=mxfp4"])
  assert _names(rules, ["layers.3.attn.v", "layers.3.mlp.gate"]) == ["bf16", "mxfp4"]
