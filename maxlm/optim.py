"""AdamW with warmup + cosine / WSD / constant schedules, global-norm clipping and a decay mask; the first
moment stored in `optim.mu_dtype`, the second in `optim.nu_dtype` (the update math in float32 either way).

A bfloat16 moment is rounded from the float32 one the update computed, by `optim.moment_rounding`: nearest
(even), which stalls a moment whose per-step change is below half a bf16 ulp (with b2 = 0.999 the second
moment stops decaying 0.1% a step: it freezes), or stochastic (the default): up with probability equal to the
fraction of an ulp cut off, so the stored moment is unbiased and keeps moving. Its random bits come from a
hash of the Adam step count, the parameter's index and each element's index (`rounding_seed`,
`random_bits16`): a resumed run draws the same bits, and nothing more is checkpointed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from maxlm.config import OptimConfig
from maxlm.offload import in_host_memory, to_device_memory, to_host_memory


def learning_rate_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
  peak = cfg.learning_rate
  decay_steps = max(1, (cfg.decay_steps or total_steps) - cfg.warmup_steps)
  warmup = optax.linear_schedule(0.0, peak, max(1, cfg.warmup_steps))
  end = peak * cfg.min_lr_ratio
  if cfg.schedule == "constant":
    after = optax.constant_schedule(peak)
  elif cfg.schedule == "cosine":
    after = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio)
  elif cfg.schedule == "wsd":  # warmup-stable-decay: flat, then linear decay over the last fraction
    n_decay = max(1, int(round(decay_steps * cfg.wsd_decay_fraction)))
    after = optax.join_schedules(
        [optax.constant_schedule(peak), optax.linear_schedule(peak, end, n_decay)],
        [decay_steps - n_decay])
  else:
    raise ValueError(f"unknown schedule {cfg.schedule!r}")
  if cfg.warmup_steps <= 0:
    return after
  return optax.join_schedules([warmup, after], [cfg.warmup_steps])


def warmup_warning(cfg: OptimConfig, total_steps: int) -> str | None:
  """A warning when the run ends inside its warmup (a short trial of a shipped config, whose warmup is 2000
  steps): the learning rate never reaches optim.learning_rate. None when the warmup ends within the run."""
  if cfg.warmup_steps < total_steps or cfg.learning_rate <= 0:
    return None
  last = float(learning_rate_schedule(cfg, total_steps)(total_steps - 1))  # step N applies the rate of count N-1
  return (f"optim.warmup_steps={cfg.warmup_steps} is not below train.steps={total_steps}: the learning "
          f"rate ends at {last:.3g}, {last / cfg.learning_rate:.1%} of optim.learning_rate={cfg.learning_rate:g} "
          f"(a shorter warmup: optim.warmup_steps=N)")


def decay_mask(params, decay_norms_and_embeddings: bool):
  """True where weight decay applies: matmul kernels; norms and embeddings only if asked."""
  def keep(path, leaf):
    names = [getattr(k, "key", str(k)) for k in path]
    if decay_norms_and_embeddings:
      return True
    return not ("scale" in names or "embedding" in names)
  return jax.tree_util.tree_map_with_path(keep, params)


MOMENT_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ROUNDING_SEED = 0x4D4C  # the stochastic rounding's fixed seed; its bits vary only with the step and the leaf
# optim.offload=host: parameter i's moments enter device memory once those of parameter i - LAG are back in
# host memory, so at most LAG parameters' moments are on the device at once, and a transfer in overlaps
# the update of the parameter before it. host_params: the same, the parameter with its moments.
LAG = 2


def _is_adam(s) -> bool:
  return isinstance(s, optax.ScaleByAdamState)


def _map_moments(state, fn):
  """`state` with (mu, nu) = fn(mu, nu) in every Adam state in it."""
  def one(s):
    return s._replace(**dict(zip(("mu", "nu"), fn(s.mu, s.nu)))) if _is_adam(s) else s
  return jax.tree_util.tree_map(one, state, is_leaf=_is_adam)


def _cast_moments(state, mu_dtype, nu_dtype):
  """`state` with its Adam moments cast to the dtypes (the counts and the rest as they are)."""
  cast = lambda tree, dtype: jax.tree_util.tree_map(lambda x: x.astype(dtype), tree)  # noqa: E731
  return _map_moments(state, lambda mu, nu: (cast(mu, mu_dtype), cast(nu, nu_dtype)))


def _mix32(h):
  """murmur3's 32-bit finalizer: a bijection of uint32 in which every output bit depends on every input bit."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def rounding_seed(count, leaf: int, moment: int):
  """The stochastic rounding's seed (a uint32) for leaf `leaf` (its index among the parameters) of moment
  `moment` (0 = mu, 1 = nu) at Adam's step `count`: a hash of the three, so from the state alone."""
  h = _mix32(jnp.uint32(ROUNDING_SEED) ^ jnp.asarray(count).astype(jnp.uint32))
  return _mix32(_mix32(h ^ jnp.uint32(leaf)) ^ jnp.uint32(moment))


def random_bits16(seed, shape: tuple[int, ...]):
  """One uniform 16-bit number (as uint32) per element of `shape`: the hash of `seed` and the element's index,
  one dimension at a time (no index wraps at 2**32 elements; XLA partitions iota, so each shard computes its
  own elements, the same bits on any mesh). Elementwise integer arithmetic only: it fuses with the moment
  update and allocates nothing (jax.random's threefry runs as a loop on CPU, holding its state per element)."""
  h = jnp.broadcast_to(jnp.asarray(seed, jnp.uint32), shape)
  for d in range(len(shape)):  # odd multiplier: distinct indices stay distinct before each (bijective) mix
    h = _mix32(h ^ (jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(0x9E3779B9)))
  return h >> 16


def stochastic_round_bf16(x, seed):
  """float32 `x` rounded to bfloat16 stochastically with the bits of `seed` (random_bits16): up (away from
  zero) with probability equal to the fraction of a bf16 ulp that truncation cuts off, else down, so
  E[result] = x (for |x| up to bf16's largest finite value; beyond it the result may be inf, as round to
  nearest gives). Uniform 16-bit numbers are added to the low 16 bits of the float32 pattern, which carry into
  the kept bits exactly when they exceed the cut-off fraction, and the low bits are dropped. inf and nan are
  rounded to nearest (the addition could turn a nan into inf, or carry it into the sign bit)."""
  x = x.astype(jnp.float32)
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  high = ((bits + random_bits16(seed, x.shape)) >> 16).astype(jnp.uint16)  # the kept half: a bf16 pattern
  return jnp.where(jnp.isfinite(x), jax.lax.bitcast_convert_type(high, jnp.bfloat16), x.astype(jnp.bfloat16))


def _round(x, dtype, stochastic: bool, count, leaf: int, moment: int, layer: int | None = None):
  """Float32 moment `x` (leaf `leaf` of moment `moment`) in its storage dtype. `layer`: x is that slice [l] of
  a stacked leaf, rounded with the bits the whole leaf's element [l, ...] gets (random_bits16 hashes dimension 0's
  index first: that step done here, the rest by random_bits16 over the slice's own dimensions)."""
  if dtype != jnp.bfloat16 or not stochastic:
    return x.astype(dtype)
  seed = rounding_seed(count, leaf, moment)
  if layer is not None:
    seed = _mix32(seed ^ (jnp.uint32(layer) * jnp.uint32(0x9E3779B9)))
  return stochastic_round_bf16(x, seed)


def _store_moments(state, mu_dtype, nu_dtype, stochastic: bool):
  """`state` (float32 moments, just updated) with its moments rounded to their storage dtypes."""
  count = _adam(state).count

  def store(tree, dtype, moment):
    flat, treedef = jax.tree_util.tree_flatten(tree)
    return treedef.unflatten([_round(x, dtype, stochastic, count, i, moment) for i, x in enumerate(flat)])
  return _map_moments(state, lambda mu, nu: (store(mu, mu_dtype, 0), store(nu, nu_dtype, 1)))


def _adam(state) -> optax.ScaleByAdamState:
  found = [s for s in jax.tree_util.tree_leaves(state, is_leaf=_is_adam) if _is_adam(s)]
  if len(found) != 1:
    raise ValueError(f"expected one Adam state, found {len(found)}")
  return found[0]


def _only(treedef, i: int, x):
  """The tree of `treedef` with x at leaf i and None at every other."""
  return treedef.unflatten([x if j == i else None for j in range(treedef.num_leaves)])


def _stacked(path) -> bool:
  """A leaf of the scanned layer stack (maxlm/model.py's `layers`: [L, ...])."""
  return any(getattr(k, "key", None) == "layers" for k in path)


def _streamed_update(inner, dtypes, stochastic, split_layers, updates, state, params):
  """`inner.update` with its moments in host memory, one parameter at a time (see LAG): each parameter's
  moments come into device memory, are upcast, updated by `inner` on a tree holding only that parameter
  (None elsewhere: Adam is elementwise, so its update is the whole-tree one), rounded to their `dtypes` (as
  `_store_moments` rounds them: the same leaf index, the same bits) and sent back. The first transfers wait
  for every gradient, so nothing of the state is on the device before the backward pass is done. The counts
  and the rest of the state make the round trip whole (a few scalars). Parameters in host memory
  (optim.offload=host_params) stream with their moments, and each is updated on the device as it streams
  (`optax.apply_updates` on the one leaf) and sent back: the update returns the new parameters, in host memory,
  where it would return the updates (`apply_updates` below takes them as they are).

  split_layers: a leaf of the scanned stack ([L, ...], `_stacked`) streams one layer at a time: slice l of its
  host arrays moved in, updated, moved back and written into them (dynamic_update_slice, in place; the next
  slice is read after that write, so a stack's layers pass one after the other). Only where the stack's first
  axis is not split over devices (no pipeline stages): a slice must be one device's own."""
  treedef = jax.tree_util.tree_structure(updates)
  flat = treedef.flatten_up_to
  adam = _adam(state)
  host_params = in_host_memory(params)
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(updates)[0]]
  mus, nus, grads, ps = flat(adam.mu), flat(adam.nu), flat(updates), flat(params)
  rest = to_device_memory(_map_moments(state, lambda mu, nu: (None, None)))  # counts, empty states
  # One element of every gradient: needs the whole backward pass, and does not make the (clipped) gradients
  # exist all at once, as a barrier on the gradients themselves would (their size again in device memory).
  done = [g[(0,) * g.ndim] for g in grads]
  split = [split_layers and _stacked(path) for path in paths]
  items = [(i, layer) for i in range(len(grads)) for layer in (range(grads[i].shape[0]) if split[i] else (None,))]
  # the host arrays as written so far (a stacked leaf's, slice by slice), and each item's writes (for LAG's gate)
  cur = {i: (mus[i], nus[i], ps[i] if host_params else None) for i in range(len(grads))}
  out_u, written, new = [None] * len(grads), [], rest
  for k, (i, layer) in enumerate(items):
    gate = done if k < LAG else written[k - LAG]
    # host_params: the parameter streams with its moments (the barrier's copy: not the forward's move of it)
    (mu, nu, p), _ = jax.lax.optimization_barrier((cur[i], gate))
    whole = (mu, nu, p)
    g = grads[i]
    if layer is not None:  # static slices of the host arrays, moved as such (no computation on host values)
      mu, nu, g = mu[layer], nu[layer], g[layer]
      p = p[layer] if host_params else ps[i][layer]
    elif not host_params:
      p = ps[i]
    mu, nu, p = to_device_memory((mu, nu, p))
    moments = (_only(treedef, i, mu.astype(jnp.float32)), _only(treedef, i, nu.astype(jnp.float32)))
    u, new = inner.update(_only(treedef, i, g), _map_moments(rest, lambda *_: moments), _only(treedef, i, p))
    u = flat(u)[i]
    new_adam = _adam(new)
    outs = [to_host_memory(_round(flat(new_adam.mu)[i], dtypes[0], stochastic, new_adam.count, i, 0, layer)),
            to_host_memory(_round(flat(new_adam.nu)[i], dtypes[1], stochastic, new_adam.count, i, 1, layer)),
            to_host_memory(optax.apply_updates(p, u)) if host_params else None]
    if layer is None:
      cur[i], out_u[i] = tuple(outs), u
    else:
      cur[i] = tuple(None if o is None else jax.lax.dynamic_update_index_in_dim(w, o, layer, 0)
                     for w, o in zip(whole, outs))
      out_u[i] = [u] if layer == 0 else out_u[i] + [u]  # offload=host: a stack's updates, slice by slice
    written.append(tuple(x for x in cur[i] if x is not None))
  new = to_host_memory(_map_moments(new, lambda mu, nu: (None, None)))
  moments = (treedef.unflatten([c[0] for c in cur.values()]), treedef.unflatten([c[1] for c in cur.values()]))
  if host_params:
    return treedef.unflatten([c[2] for c in cur.values()]), _map_moments(new, lambda *_: moments)
  updates = [jnp.stack(u) if isinstance(u, list) else u for u in out_u]
  return treedef.unflatten(updates), _map_moments(new, lambda *_: moments)


def with_moment_dtype(inner: optax.GradientTransformation, mu_dtype, nu_dtype=None,
                      stochastic: bool = False, split_layers: bool = False) -> optax.GradientTransformation:
  """`inner` (AdamW: one Adam state, elementwise) with its first moment stored in `mu_dtype`, its second in
  `nu_dtype` (default: `mu_dtype`), and both updated in float32: each update upcasts them (exact), runs
  `inner`, and rounds the new moments to their dtypes (to nearest even, or with `stochastic` stochastically:
  `stochastic_round_bf16`). The state's tree is `inner`'s: only the moments' dtypes differ. With float32
  moments the casts are no-ops and the state and updates are `inner`'s, bit for bit. A state in host
  memory (optim.offload=host, host_params) is streamed through the device one parameter at a time, rounded the
  same way; with the parameters in host memory (host_params) the update returns the new parameters.
  split_layers: the scanned stack streams one layer at a time (`_streamed_update`)."""
  nu_dtype = mu_dtype if nu_dtype is None else nu_dtype

  def init(params):
    return _cast_moments(inner.init(params), mu_dtype, nu_dtype)

  def update(updates, state, params=None):
    if in_host_memory(state) or in_host_memory(params):
      return _streamed_update(inner, (mu_dtype, nu_dtype), stochastic, split_layers, updates, state, params)
    new_updates, new_state = inner.update(updates, _cast_moments(state, jnp.float32, jnp.float32), params)
    return new_updates, _store_moments(new_state, mu_dtype, nu_dtype, stochastic)
  return optax.GradientTransformation(init, update)


def apply_updates(optimizer: optax.GradientTransformation, grads, opt_state, params):
  """(new params, new optimizer state): `optimizer`'s update applied to `params`. Parameters in host memory
  (optim.offload=host_params): the streamed update (`_streamed_update`) applied each parameter's update as it
  streamed and returned the new parameters, in host memory, where the updates would be."""
  updates, new_state = optimizer.update(grads, opt_state, params)
  if in_host_memory(params):
    return updates, new_state
  return optax.apply_updates(params, updates), new_state


def make_optimizer(cfg: OptimConfig, total_steps: int,
                   split_layers: bool = False) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """(AdamW as optim.* says, its schedule). split_layers: an offloaded state (optim.offload) streams the scanned
  layer stack one layer at a time (`_streamed_update`: where the stack's layers are not split over pipeline
  stages)."""
  schedule = learning_rate_schedule(cfg, total_steps)
  parts = []
  if cfg.clip_grad_norm > 0:
    parts.append(optax.clip_by_global_norm(cfg.clip_grad_norm))
  adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                      mask=lambda p: decay_mask(p, cfg.decay_norms_and_embeddings))
  parts.append(with_moment_dtype(adamw, MOMENT_DTYPES[cfg.mu_dtype], MOMENT_DTYPES[cfg.nu_dtype],
                                 stochastic=cfg.moment_rounding == "stochastic", split_layers=split_layers))
  return optax.chain(*parts), schedule
