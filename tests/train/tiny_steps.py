"""A few train steps of the tiny Llama (float32 compute) on given batches: what the sharded-step and microbatch
tests compare. Imported by the tests and by their subprocess scripts (a device count fixed at start)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fp4jax.nn.llama.model import unstacked_params
from train import config, train


def tiny_steps(batches: list[np.ndarray], mesh, microbatches: int = 1, scan_layers: bool | str = "auto",
               **settings) -> dict:
  """{"losses", "specs" (the state's partition specs), "params" (every float32 state leaf, flattened, in the
  unrolled model's layout: a scanned model's stacks split per layer)} after one train step per batch of int32
  [B, 33] tokens on `mesh`, with `microbatches` passes per step and the config's `model.scan_layers`.
  settings: other config sections' entries (e.g. route="mxfp4", model={"dtype": "bfloat16"})."""
  model = {"preset": "tiny", "dtype": "float32", "scan_layers": scan_layers, **settings.pop("model", {})}
  cfg = config.from_dict({"model": model,
                          "data": {"seq_len": 32, "batch_size": len(batches[0]), "microbatches": microbatches},
                          "optim": {"lr": 1e-3, "warmup": 0}, "run": {"steps": 4}, **settings})
  ts = train.init_train_state(cfg, 257, mesh)
  specs = {str(l.sharding.spec) for l in jax.tree.leaves(ts.state)}
  losses = []
  for i, b in enumerate(batches):
    ts.state, loss, _ = ts.train_step(ts.state, train.to_global(b, ts.batch_sharding), jnp.int32(i))
    losses.append(float(loss))
  model, _ = nnx.merge(ts.graphdef, ts.state)
  state = unstacked_params(nnx.to_pure_dict(ts.state), model.block_groups)
  params = np.concatenate([np.asarray(l, np.float32).ravel() for l in jax.tree.leaves(state)
                           if l.dtype == jnp.float32])
  return {"losses": losses, "specs": sorted(specs), "params": params}
