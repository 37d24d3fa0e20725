"""Llama model configuration: frozen dataclasses and named size presets."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any


class FieldError(ValueError):
  """A field of a LlamaConfig or Llama3RopeScaling outside its range. The message names it `{class}.{field}`;
  `named(key)` is the same message naming it `key` instead (the config-file key that set it, say)."""

  def __init__(self, owner: str, field: str, value: Any, need: str):
    self.field, self.value, self.need = field, value, need
    super().__init__(self.named(f"{owner}.{field}"))

  def named(self, key: str) -> str:
    return f"{key}={self.value!r} must be {self.need}"


def _check_fields(cfg: Any, kinds: dict[str, str]) -> None:
  """Checks each field of the frozen dataclass `cfg` named in `kinds`, in order: "count" an int >= 1, "positive"
  a finite number > 0, "bool" True or False. A wrong type is a TypeError (a string "false" would be truthy, a
  dict no Llama3RopeScaling), a value out of range a FieldError (n_heads=0 divides by zero, rope_theta=0 or
  norm_eps < 0 give NaN logits). NumPy scalars are stored as the int or float they hold."""
  owner = type(cfg).__name__
  for name, kind in kinds.items():
    value = getattr(cfg, name)
    if kind == "bool":
      if not isinstance(value, bool):
        raise TypeError(f"{owner}.{name} takes True or False, got {value!r}")
      continue
    count = kind == "count"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if count else numbers.Real):
      raise TypeError(f"{owner}.{name} takes {'an int' if count else 'a number'}, got {value!r}")
    value = int(value) if count else float(value)
    object.__setattr__(cfg, name, value)
    if not (value >= 1 if count else 0 < value < math.inf):
      raise FieldError(owner, name, value, ">= 1" if count else "a finite number > 0")


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
  """Llama 3.1 RoPE frequency scaling (long-context extension); see `layers.rope_frequencies`."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192

  def __post_init__(self):
    _check_fields(self, {"factor": "positive", "low_freq_factor": "positive", "high_freq_factor": "positive",
                         "original_max_position": "count"})
    if not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(f"{self.high_freq_factor=} must exceed {self.low_freq_factor=}")


ATTENTION_IMPLS = ("auto", "xla", "cudnn", None)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Llama shape and numerics. head_dim = dim // n_heads; n_heads must be a multiple of n_kv_heads (GQA). Sizes
  are ints >= 1, rope_theta, norm_eps and init_std finite numbers > 0, the flags True or False: anything else
  is a TypeError or a `FieldError` (a ValueError) on construction.

  `init_std`: every matrix (embedding included) starts as normal(0, init_std), as HF Llama's
  initializer_range. `attention_impl`: "auto" (default) takes cuDNN's fused flash attention when compiling for a
  GPU and the call qualifies (`layers.attention`), else XLA's; "xla", "cudnn" or None (JAX's own pick, XLA's
  materialized scores in JAX 0.11) go to `jax.nn.dot_product_attention(implementation=...)` as they are.
  `fuse_linears`: run q, k, v (and gate, up) as one product each (`nn.linear.fused_call`: x quantized once,
  one GEMM) where their routes agree; the parameters stay one kernel per linear either way.
  """

  vocab_size: int
  dim: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  ffn_dim: int
  max_seq_len: int
  rope_theta: float = 500000.0
  rope_scaling: Llama3RopeScaling | None = None
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  init_std: float = 0.02
  attention_impl: str | None = "auto"
  fuse_linears: bool = True

  def __post_init__(self):
    _check_fields(self, {**dict.fromkeys(("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                                          "max_seq_len"), "count"),
                         "rope_theta": "positive", "norm_eps": "positive", "tie_embeddings": "bool",
                         "init_std": "positive", "fuse_linears": "bool"})
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
      raise TypeError(f"LlamaConfig.rope_scaling takes a Llama3RopeScaling or None, got {self.rope_scaling!r} "
                      f"(Llama3RopeScaling(**mapping) builds one from a mapping)")
    if self.dim % self.n_heads:
      raise ValueError(f"{self.dim=} must be a multiple of {self.n_heads=}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"{self.n_heads=} must be a multiple of {self.n_kv_heads=}")
    if self.head_dim % 2:
      raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim=}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise FieldError("LlamaConfig", "attention_impl", self.attention_impl, f"one of {list(ATTENTION_IMPLS)}")

  @property
  def head_dim(self) -> int:
    return self.dim // self.n_heads

  def num_params(self) -> int:
    """Exact parameter count of `Llama(self)` (embedding, blocks, final norm, lm_head unless tied)."""
    d, hd = self.dim, self.head_dim
    attn = d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2  # q, o; k, v
    mlp = 3 * d * self.ffn_dim
    block = attn + mlp + 2 * d  # two RMSNorm scales
    embed = self.vocab_size * d
    head = 0 if self.tie_embeddings else d * self.vocab_size
    return embed + self.n_layers * block + d + head

  @classmethod
  def preset(cls, name: str, **overrides) -> LlamaConfig:
    """A named size from `PRESETS`, with fields replaced by `overrides` (e.g. vocab_size=tokenizer's)."""
    if name not in PRESETS:
      raise ValueError(f"unknown Llama preset {name!r}; presets: {list(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


# GPT-2 BPE vocabulary (50257) padded to a multiple of 128 for the small presets; these tie their
# embeddings (as GPT-2 and SmolLM do), which keeps the lm_head in bf16 by construction.
_GPT2_VOCAB = 50304

PRESETS: dict[str, LlamaConfig] = {
    # CPU tests only.
    "tiny": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192,
                        max_seq_len=128, rope_theta=10000.0),
    "30m": LlamaConfig(vocab_size=_GPT2_VOCAB, dim=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_dim=1024,
                       max_seq_len=1024, tie_embeddings=True),
    "125m": LlamaConfig(vocab_size=_GPT2_VOCAB, dim=768, n_layers=12, n_heads=12, n_kv_heads=4,
                        ffn_dim=2048, max_seq_len=2048, tie_embeddings=True),
    "350m": LlamaConfig(vocab_size=_GPT2_VOCAB, dim=1024, n_layers=24, n_heads=16, n_kv_heads=4,
                        ffn_dim=3072, max_seq_len=2048, tie_embeddings=True),
    # Llama 3.2 1B block shapes, untied, with the GPT-2 vocabulary.
    "1b": LlamaConfig(vocab_size=_GPT2_VOCAB, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                      ffn_dim=8192, max_seq_len=4096),
    # Llama 3.1 8B.
    "llama3_8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                             ffn_dim=14336, max_seq_len=8192, rope_scaling=Llama3RopeScaling()),
}
