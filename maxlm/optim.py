"""AdamW with warmup + cosine / WSD / constant schedules, global-norm clipping and a decay mask; the moments
stored in `optim.state_dtype` (the update math in float32 either way)."""

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


STATE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# optim.offload=host: parameter i's moments enter device memory once those of parameter i - LAG are back in
# host memory, so at most LAG parameters' moments are on the device at once, and a transfer in overlaps
# the update of the parameter before it.
LAG = 2


def _is_adam(s) -> bool:
  return isinstance(s, optax.ScaleByAdamState)


def _map_moments(state, fn):
  """`state` with (mu, nu) = fn(mu, nu) in every Adam state in it."""
  def one(s):
    return s._replace(**dict(zip(("mu", "nu"), fn(s.mu, s.nu)))) if _is_adam(s) else s
  return jax.tree_util.tree_map(one, state, is_leaf=_is_adam)


def _cast_moments(state, dtype):
  """`state` with its Adam moments cast to `dtype` (the counts and the rest as they are)."""
  cast = lambda tree: jax.tree_util.tree_map(lambda x: x.astype(dtype), tree)  # noqa: E731
  return _map_moments(state, lambda mu, nu: (cast(mu), cast(nu)))


def _adam(state) -> optax.ScaleByAdamState:
  found = [s for s in jax.tree_util.tree_leaves(state, is_leaf=_is_adam) if _is_adam(s)]
  if len(found) != 1:
    raise ValueError(f"expected one Adam state, found {len(found)}")
  return found[0]


def _only(treedef, i: int, x):
  """The tree of `treedef` with x at leaf i and None at every other."""
  return treedef.unflatten([x if j == i else None for j in range(treedef.num_leaves)])


def _streamed_update(inner, dtype, updates, state, params):
  """`inner.update` with its moments in host memory, one parameter at a time (see LAG): each parameter's
  moments come into device memory, are upcast, updated by `inner` on a tree holding only that parameter
  (None elsewhere: Adam is elementwise, so its update is the whole-tree one), rounded to `dtype` and sent
  back. The first transfers wait for every gradient, so nothing of the state is on the device before the
  backward pass is done. The counts and the rest of the state make the round trip whole (a few scalars)."""
  treedef = jax.tree_util.tree_structure(updates)
  flat = treedef.flatten_up_to
  adam = _adam(state)
  mus, nus, grads, ps = flat(adam.mu), flat(adam.nu), flat(updates), flat(params)
  rest = to_device_memory(_map_moments(state, lambda mu, nu: (None, None)))  # counts, empty states
  # One element of every gradient: needs the whole backward pass, and does not make the (clipped) gradients
  # exist all at once, as a barrier on the gradients themselves would (their size again in device memory).
  done = [g[(0,) * g.ndim] for g in grads]
  out_u, out_mu, out_nu, new = [], [], [], rest
  for i in range(len(grads)):
    gate = done if i < LAG else (out_mu[i - LAG], out_nu[i - LAG])
    (mu, nu), _ = jax.lax.optimization_barrier(((mus[i], nus[i]), gate))
    mu, nu = to_device_memory((mu, nu))
    moments = (_only(treedef, i, mu.astype(jnp.float32)), _only(treedef, i, nu.astype(jnp.float32)))
    u, new = inner.update(_only(treedef, i, grads[i]), _map_moments(rest, lambda *_: moments),
                          _only(treedef, i, ps[i]))
    out_u.append(flat(u)[i])
    new_adam = _adam(new)
    out_mu.append(to_host_memory(flat(new_adam.mu)[i].astype(dtype)))
    out_nu.append(to_host_memory(flat(new_adam.nu)[i].astype(dtype)))
  new = to_host_memory(_map_moments(new, lambda mu, nu: (None, None)))
  moments = (treedef.unflatten(out_mu), treedef.unflatten(out_nu))
  return treedef.unflatten(out_u), _map_moments(new, lambda *_: moments)


def with_moment_dtype(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
  """`inner` (AdamW: one Adam state, elementwise) with its moments stored in `dtype` and updated in
  float32: each update upcasts them (exact), runs `inner`, and rounds the new moments to `dtype` (round to
  nearest even, as every JAX cast). The state's tree is `inner`'s: only the moments' dtype differs. With
  float32 moments the casts are no-ops and the state and updates are `inner`'s, bit for bit. A state in
  host memory (optim.offload=host) is streamed through the device one parameter at a time."""
  def init(params):
    return _cast_moments(inner.init(params), dtype)

  def update(updates, state, params=None):
    if in_host_memory(state):
      return _streamed_update(inner, dtype, updates, state, params)
    new_updates, new_state = inner.update(updates, _cast_moments(state, jnp.float32), params)
    return new_updates, _cast_moments(new_state, dtype)
  return optax.GradientTransformation(init, update)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  schedule = learning_rate_schedule(cfg, total_steps)
  parts = []
  if cfg.clip_grad_norm > 0:
    parts.append(optax.clip_by_global_norm(cfg.clip_grad_norm))
  adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                      mask=lambda p: decay_mask(p, cfg.decay_norms_and_embeddings))
  parts.append(with_moment_dtype(adamw, STATE_DTYPES[cfg.state_dtype]))
  return optax.chain(*parts), schedule
