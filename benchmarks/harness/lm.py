"""Training a language model on a token stream: every seed at once (``vmap``), steps in a ``fori_loop``.

A :class:`LMRun` holds one method's seeds. The training windows (from
:func:`harness.text.windows`) are taken in order, cycling from epoch to epoch,
with no state carried between windows; each window's loss is the mean over its
real tokens (the padding of the last, shorter window has weight 0). A call of
:meth:`LMRun.advance` takes a number of steps given at run time (one
compilation serves every chunk, and 0 only evaluates), then the mean token loss
on the validation and test windows, without dropout. Seed ``s`` fixes the
initialisation and the dropout masks (:func:`seed_keys`), the same for every
method.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import report


def seed_keys(seed):
  """(init key, dropout key) of seed ``seed``: the same for every method."""
  return tuple(jax.random.split(jax.random.key(seed)))


def eval_schedule(total_steps: int, eval_steps: int) -> list[int]:
  """Steps per chunk: 0 (the evaluation at initialisation), then ``eval_steps`` each, the last one shorter."""
  return [0] + [min(eval_steps, total_steps - done) for done in range(0, total_steps, eval_steps)]


# The initialisation runs once: compiled with little optimisation, it compiles in a third of the time.
QUICK_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.lru_cache(maxsize=4)
def init_params(model, seeds: tuple, length: int):
  """The parameters of each seed (leading seed axis) for windows of ``length`` tokens; computed once
  per model and shared by every method."""
  init = jax.vmap(lambda seed: model.init({"params": seed_keys(seed)[0]}, jnp.zeros((1, length), jnp.int32))["params"])
  seeds = jnp.asarray(seeds)
  return jax.jit(init).lower(seeds).compile(QUICK_COMPILE)(seeds)


class LMRun:
  """One method's seeds, trained together.

  Args:
    model: a Flax module ``model.apply({"params": p}, tokens, deterministic=...)`` -> logits,
      with dropout drawn from the rng ``"dropout"``.
    tx: the optimizer.
    data: ``(train, valid, test)`` windows, each ``(inputs, targets, weights)`` of shape
      ``(n_windows, columns, bptt)``.
    seeds: the seeds, trained at once.
    probes: ``params -> {name: scalar}`` recorded at each evaluation (e.g. the largest weight).
  """

  def __init__(self, *, model, tx: optax.GradientTransformation, data, seeds: Sequence[int], probes=None):
    self.data = jax.device_put(data)
    self.seeds = jnp.asarray(seeds)
    self.steps_per_epoch = int(data[0][0].shape[0])

    def init_one(params, seed):
      return params, tx.init(params), seed_keys(seed)[1], jnp.zeros((), jnp.int32)

    def token_losses(params, x, y, key=None):
      rngs = {} if key is None else {"dropout": key}
      logits = model.apply({"params": params}, x, deterministic=key is None, rngs=rngs)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y)

    def window_loss(params, x, y, w, key):
      return jnp.sum(token_losses(params, x, y, key) * w) / jnp.sum(w)

    def held_out(params, valid, test):
      """Validation and test loss in one pass over both sets' windows (one traced forward pass)."""
      both = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), valid, test)
      sums, counts = jax.lax.map(lambda win: (jnp.sum(token_losses(params, *win[:2]) * win[2]), jnp.sum(win[2])), both)
      n = valid[0].shape[0]
      return {
        "valid_loss": jnp.sum(sums[:n]) / jnp.sum(counts[:n]),
        "test_loss": jnp.sum(sums[n:]) / jnp.sum(counts[n:]),
      }

    def chunk_one(carry, data, n_steps):
      params, opt_state, dropout_key, step = carry
      train, valid, test = data

      def train_step(_, inner):
        params, opt_state, step, loss_sum, count = inner
        x, y, w = (a[step % a.shape[0]] for a in train)
        loss, grads = jax.value_and_grad(window_loss)(params, x, y, w, jax.random.fold_in(dropout_key, step))
        updates, opt_state = tx.update(grads, opt_state, params)
        return (
          optax.apply_updates(params, updates),
          opt_state,
          step + 1,
          loss_sum + loss * jnp.sum(w),
          count + jnp.sum(w),
        )

      params, opt_state, step, loss_sum, count = jax.lax.fori_loop(
        0, n_steps, train_step, (params, opt_state, step, jnp.zeros(()), jnp.zeros(()))
      )
      metrics = {
        "train_loss": jnp.where(count > 0, loss_sum / jnp.maximum(count, 1.0), jnp.nan),
        **held_out(params, valid, test),
        **(probes(params) if probes else {}),
      }
      return (params, opt_state, dropout_key, step), metrics

    self.model = model
    self._init = jax.jit(jax.vmap(init_one))
    self._chunk = jax.jit(jax.vmap(chunk_one, in_axes=(0, None, None)))
    self.carry = None
    self.history: dict[str, list] = {}
    self.steps: list[int] = []
    self.compile_s = self.run_s = self.init_eval_s = 0.0

  @property
  def params(self):
    """The seeds' current parameters, each leaf with a leading seed axis."""
    return self.carry[0]

  def compile(self, compiler_options: Mapping | None = None) -> None:
    """Initialises the seeds and compiles the chunk (``compiler_options`` as XLA's, e.g. for a quick test)."""
    t0 = time.perf_counter()
    params = init_params(self.model, tuple(int(s) for s in self.seeds), self.data[0][0].shape[-1])
    self.carry = self._init(params, self.seeds)
    self._chunk = self._chunk.lower(self.carry, self.data, jnp.int32(0)).compile(compiler_options=compiler_options)
    self.compile_s = time.perf_counter() - t0

  def advance(self, n_steps: int) -> dict:
    """``n_steps`` training steps, then an evaluation; returns its metrics (numpy, per seed)."""
    if self.carry is None:
      self.compile()
    t0 = time.perf_counter()
    self.carry, metrics = self._chunk(self.carry, self.data, jnp.int32(n_steps))
    metrics = jax.device_get(metrics)
    self.run_s += time.perf_counter() - t0
    if not self.steps:
      self.init_eval_s = self.run_s
    self.steps.append((self.steps[-1] if self.steps else 0) + n_steps)
    for k, v in metrics.items():
      self.history.setdefault(k, []).append(np.asarray(v))
    return metrics


def train(runs: Mapping[str, LMRun], schedule: Sequence[int], *, quiet: bool, header: str, after_round: Callable):
  """Advances every run by ``schedule``'s chunks, the runs in turn one chunk at a time (an interrupted
  run leaves them at the same step); ``after_round()`` after each chunk. Shows a progress bar (none if
  ``quiet``) and writes ``header``, each run's cost and a projection of the whole run after the first
  trained chunk, and the validation losses after each chunk."""
  progress = report.progress(len(runs) * sum(schedule), quiet, unit="step")
  first = next(iter(runs.values()))
  progress.write(f"{header}; {first.steps_per_epoch} steps/epoch, evaluation every {max(schedule)} steps")
  for chunk, n_steps in enumerate(schedule):
    for name, run in runs.items():
      progress.set_description(f"epoch {(run.steps[-1] if run.steps else 0) / run.steps_per_epoch:.2f} {name}")
      run.advance(n_steps)
      progress.update(n_steps)
    if chunk == 1:  # chunk 0 only evaluated; chunk 1 trained n_steps and evaluated once more
      total = 0.0
      for name, run in runs.items():
        step_s = (run.run_s - 2 * run.init_eval_s) / n_steps
        total += step_s * sum(schedule) + run.init_eval_s * len(schedule)
        progress.write(
          f"{name}: compile {run.compile_s:.1f} s, evaluation {run.init_eval_s:.1f} s, "
          f"{step_s:.2f} s/step for {len(run.seeds)} seed(s)"
        )
      progress.write(f"projection: all methods in about {total / 60:.1f} min (this machine, now)")
    losses = "  ".join(f"{name}: {float(np.mean(run.history['valid_loss'][-1])):.3f}" for name, run in runs.items())
    progress.write(f"epoch {first.steps[-1] / first.steps_per_epoch:6.2f}  valid loss  {losses}")
    after_round()
  progress.close()
