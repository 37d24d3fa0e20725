"""Where a compiled step spends its device time: a profile's kernels grouped by category.

`categorize(hlo_text)` classifies every instruction of a compiled module (optimized HLO text) by what it
does; `device_events(xplane_path, module)` lists a profile's device events with the instruction (`hlo_op`)
that launched each. `attribute` joins the two; `breakdown` sums the result by category:

  fp8 gemm       cuBLAS(Lt) GEMMs reading float8 operands (the fp8 backend's MXFP4 products, the fp8 route)
  bf16 gemm      other cuBLAS(Lt) GEMMs and XLA's own GEMM fusions (bf16 routes, NVFP4's exact bf16 GEMMs)
  quantizers     Pallas kernels (fp4jax's fused quantizers)
  attention      cuDNN fused attention (the XLA attention path counts as GEMMs and elementwise)
  fp4 glue       the other ops inside fp4_dot (re-encodes, scale products, layout copies): their name stack
                 holds fp4_dot's jitted passes; not the ops of an x given as the op producing it (SwiGLU of a
                 `Produced`, and its derivative), which fp4_dot computes where a bf16 model would too:
                 elementwise
  optimizer      ops outside the gradient (no jvp/transpose in their name stack): AdamW, the loss's reductions
                 after value_and_grad
  elementwise    everything else: norms, activations, residuals, softmax, casts, copy fusions
  copies         the device's memcpy operations (not kernels): XLA writes a dynamic-update-slice of a contiguous
                 slice, e.g. a scanned layer's saved value into its stack, as a device-to-device memcpy
  communication  collectives (all-reduce, all-gather, reduce-scatter, collective-permute, all-to-all)

The categories come from the instruction (custom-call target, fusion kind, name stack) where the module text
names it; kernel names (which change between cuBLAS versions) are only the fallback.
"""

from __future__ import annotations

import collections
import re

from fp4jax.numerics.produced import SCOPE as _PRODUCER_SCOPE

CATEGORIES = ("fp8 gemm", "bf16 gemm", "quantizers", "attention", "fp4 glue", "elementwise", "optimizer", "copies",
              "communication")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
# Name-stack fragments of fp4_dot's jitted passes (fp4jax/dot.py: _forward, _forward_saving, _backward).
_FP4_DOT_SCOPES = ("jit(_forward)", "jit(_forward_saving)", "jit(_backward)")


def _category(rhs: str) -> str:
  """The category of one instruction, from the text after `name = `."""
  target = re.search(r'custom_call_target="([^"]+)"', rhs)
  op_name = re.search(r'op_name="([^"]*)"', rhs)
  scope = op_name.group(1) if op_name else ""
  opcode = re.search(r"\s([a-z][a-z0-9\-]*)\(", rhs)
  opcode = opcode.group(1) if opcode else ""
  if target:
    name = target.group(1)
    if "cublas" in name:
      return "fp8 gemm" if "f8" in name or re.search(r"\bf8e[45]m[23]", rhs) else "bf16 gemm"
    if "cudnn" in name and ("fmha" in name or "attention" in name):
      return "attention"
    if "triton" in name:
      return "quantizers"
  if opcode in _COLLECTIVES or any(opcode.startswith(c) for c in _COLLECTIVES):
    return "communication"
  if opcode == "fusion" and ("__triton_gemm" in rhs or "gemm_fusion" in rhs or '"kind":"__cublas' in rhs):
    return "bf16 gemm"
  if opcode == "dot":
    return "bf16 gemm"
  if _PRODUCER_SCOPE in scope:
    return "elementwise"
  if any(s in scope for s in _FP4_DOT_SCOPES):
    return "fp4 glue"
  if scope and "jvp(" not in scope and "transpose(" not in scope:
    return "optimizer"
  return "elementwise"


def _instructions(hlo_text: str) -> dict[str, str]:
  """Instruction name -> the rest of its line (result type, operands, attributes), for every instruction in a
  compiled module's text."""
  return {m.group(1): m.group(2) for line in hlo_text.splitlines()
          if (m := _INSTRUCTION.match(line)) and not line.lstrip().startswith(("HloModule", "ENTRY", "//"))}


def categorize(hlo_text: str) -> dict[str, str]:
  """Instruction name -> category (`CATEGORIES`) for every instruction in a compiled module's text."""
  return {name: _category(rest) for name, rest in _instructions(hlo_text).items()}


def _kernel_category(kernel: str) -> str | None:
  """A category from a kernel's name alone (the fallback for events whose `hlo_op` the module text lacks)."""
  k = kernel.lower()
  rules = ((("e4m3", "e5m2", "f8f8", "fp8"), "fp8 gemm"), (("fmha", "flash", "cudnn", "sdpa"), "attention"),
           (("gemm", "nvjet", "xmma", "cutlass", "wgmma"), "bf16 gemm"), (("fp4jax", "pallas"), "quantizers"),
           (("nccl",), "communication"), (("fusion", "copy", "transpose", "reduce"), "elementwise"))
  return next((cat for words, cat in rules if any(w in k for w in words)), None)


def device_events(xplane_path: str, module: str | None = None) -> list[tuple[str, str, float]]:
  """(hlo_op, kernel name, seconds) of each device event in a profile (`jax.profiler.trace`'s .xplane.pb) of
  the module whose name contains `module` (all modules if None). Device planes are the GPU ones; on a machine
  without one, the host's XLA events stand in (for tests)."""
  from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top
  data = ProfileData.from_file(xplane_path)
  planes = [p for p in data.planes if p.name.startswith("/device:GPU")]
  planes = planes or [p for p in data.planes if p.name.startswith("/host:CPU")]
  events = []
  for plane in planes:
    for line in plane.lines:
      for event in line.events:
        stats = dict(event.stats)
        op = stats.get("hlo_op")
        if op is None or (module and module not in str(stats.get("hlo_module", ""))):
          continue
        events.append((str(op), str(event.name), event.duration_ns * 1e-9))
  return events


def _op_name(op: str) -> str:
  """An event's `hlo_op` as the module text names the instruction (no leading %, nothing after a space)."""
  return op.strip().lstrip("%").split()[0] if op.strip() else op


def attribute(hlo_text: str, events: list[tuple[str, str, float]]) -> dict[tuple[str, str, str], float]:
  """Seconds per (category, hlo_op, kernel) of `events`: an event's category is its instruction's in the compiled
  module's text; events whose instruction the text lacks fall back to their kernel's name (`_kernel_category`),
  else "unattributed"; memcpy events are "copies". What `breakdown` and `top_kernels` summarize."""
  kinds = categorize(hlo_text)
  out: dict[tuple[str, str, str], float] = collections.defaultdict(float)
  for op, kernel, seconds in events:
    if kernel.lower().startswith("memcpy"):  # a copy engine's event (MemcpyD2D, ...), whatever launched it
      category = "copies"
    else:
      category = kinds.get(_op_name(op)) or _kernel_category(kernel) or "unattributed"
    out[(category, op, kernel)] += seconds
  return out


def breakdown(attributed: dict[tuple[str, str, str], float]) -> tuple[dict[str, float], list]:
  """(seconds per category, every category present, plus "unattributed"; the largest unattributed events as
  (hlo_op, kernel, seconds)) of `attribute`'s result."""
  out = dict.fromkeys((*CATEGORIES, "unattributed"), 0.0)
  missing: dict[tuple[str, str], float] = collections.defaultdict(float)
  for (category, op, kernel), seconds in attributed.items():
    out[category] += seconds
    if category == "unattributed":
      missing[(op, kernel)] += seconds
  top = sorted(((op, kernel, s) for (op, kernel), s in missing.items()), key=lambda e: -e[2])[:8]
  return out, top


_GEMM_CALL = re.compile(r"=\s*\(?([a-z]\w*\[[\d,]*\](?:\{[\d,]*\})?).*custom_call_target=\"([^\"]*cublas[^\"]*)\"")


def gemm_signatures(hlo_text: str) -> dict[str, str]:
  """Instruction name -> "result shape (contracting lhs/rhs dims)" for every cuBLAS(Lt) GEMM of a compiled
  module's text (which names operands without their shapes): which product a GEMM event is, e.g. to match
  one GEMM between a scanned and an unrolled program."""
  out = {}
  for line in hlo_text.splitlines():
    m, call = _INSTRUCTION.match(line), _GEMM_CALL.search(line)
    if not (m and call):
      continue
    dims = [",".join(re.findall(r'"(\d+)"', d)) for d in
            re.findall(r'"(?:lhs|rhs)_contracting_dimensions":\[([^\]]*)\]', line)]
    out[m.group(1)] = call.group(1) + (f" (contracting {'/'.join(dims)})" if dims else "")
  return out


def top_gemms(attributed: dict[tuple[str, str, str], float], signatures: dict[str, str],
              n: int = 20) -> list[tuple[str, str, str, float]]:
  """The `n` GEMM instructions with the most device time in `attribute`'s result, as (category, signature
  (`gemm_signatures`), kernel, seconds summed over launches; a scanned body's GEMM runs once per layer)."""
  totals: dict[tuple[str, str, str], float] = collections.defaultdict(float)
  for (category, op, kernel), seconds in attributed.items():
    if category.endswith("gemm"):
      totals[(category, signatures.get(_op_name(op), _op_name(op)), kernel)] += seconds
  return [(c, sig, k, s) for (c, sig, k), s in sorted(totals.items(), key=lambda e: -e[1])[:n]]


def top_kernels(attributed: dict[tuple[str, str, str], float], n: int = 15) -> list[tuple[str, str, float]]:
  """The `n` kernels with the most device time in `attribute`'s result, as (category, kernel name, seconds
  summed over launches): what to compare when two programs' categories differ (a scanned and an unrolled step,
  say)."""
  totals: dict[tuple[str, str], float] = collections.defaultdict(float)
  for (category, _, kernel), seconds in attributed.items():
    totals[(category, kernel)] += seconds
  return [(c, k, s) for (c, k), s in sorted(totals.items(), key=lambda e: -e[1])[:n]]


def top_copies(attributed: dict[tuple[str, str, str], float], hlo_text: str,
               n: int = 20) -> list[tuple[str, str, str, float]]:
  """The `n` instructions whose copies ("copies": memcpy events) took the most device time in `attribute`'s result,
  as (instruction, its result type and operands as the module text gives them, the end of its op_name, seconds
  summed over launches): which saved values a scanned step copies into its stacks, say, and from what."""
  lines = _instructions(hlo_text)
  totals: dict[str, float] = collections.defaultdict(float)
  for (category, op, _), seconds in attributed.items():
    if category == "copies":
      totals[_op_name(op)] += seconds
  out = []
  for op, seconds in sorted(totals.items(), key=lambda e: -e[1])[:n]:
    rhs = lines.get(op, "")
    op_name = re.search(r'op_name="([^"]*)"', rhs)
    out.append((op, re.sub(r",?\s*(metadata|backend_config)=.*", "", rhs)[:200],
                op_name.group(1)[-120:] if op_name else "", seconds))
  return out


_GEMMS = ("fp8 gemm", "bf16 gemm")
# What a quantized route does besides its GEMMs that a bf16 step does not: the parts of `against_bf16`.
_QUANTIZED_WORK = ("quantizers", "fp4 glue")


def against_bf16(route: dict[str, float], route_step: float, bf16: dict[str, float],
                 bf16_step: float) -> dict | None:
  """A route's profiled step against bf16's (breakdowns in seconds per category, `breakdown`'s, and step seconds):

    bound_s      the route's step if everything but its GEMMs took what it takes bf16: bf16's step less bf16's
                 GEMMs, plus the route's GEMMs (the fastest the route's GEMMs allow against this bf16 step)
    bound_x      bf16's step / bound_s: the most "x bf16" the route can reach with these GEMMs
    overhead_s   the route's step less bound_s, in parts: quantizers and fp4 glue (bf16 has neither), copies
                 over bf16's (a scanned step's saved values, `copies`), and the rest (other categories and idle
                 time, over bf16's; negative where the route takes less)

  None where bf16's profiled GEMMs take longer than its timed step: the profile and the timing are separate runs,
  which on a loaded machine disagree, and the bound would be meaningless (it came out negative in a CI run).
  """
  besides_gemms = bf16_step - sum(bf16[c] for c in _GEMMS)
  if besides_gemms < 0:
    return None
  bound = besides_gemms + sum(route[c] for c in _GEMMS)
  parts = {c: route[c] for c in _QUANTIZED_WORK} | {"copies": route["copies"] - bf16["copies"]}
  overhead = route_step - bound
  return {"bound_s": bound, "bound_x": bf16_step / bound, "overhead_s": overhead,
          "overhead_parts_s": parts | {"rest": overhead - sum(parts.values())}}
