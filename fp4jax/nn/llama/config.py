"""Llama model configuration: frozen dataclasses and named size presets."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
  """Llama 3.1 RoPE frequency scaling (long-context extension); see `layers.rope_frequencies`."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192

  def __post_init__(self):
    if not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(f"{self.high_freq_factor=} must exceed {self.low_freq_factor=}")


ATTENTION_IMPLS = ("auto", "xla", "cudnn", None)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Llama shape and numerics. head_dim = dim // n_heads; n_heads must be a multiple of n_kv_heads (GQA).

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
    if self.dim % self.n_heads:
      raise ValueError(f"{self.dim=} must be a multiple of {self.n_heads=}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"{self.n_heads=} must be a multiple of {self.n_kv_heads=}")
    if self.head_dim % 2:
      raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim=}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"unknown {self.attention_impl=}; valid: {ATTENTION_IMPLS}")

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
