#!/usr/bin/env python
"""Cost of cola's samplers: a sampler step against the optimizer's, chains against blackjax's, the noise, memory.

Each timing runs in one process, interleaved with its baseline after warm-up (``harness.timing.measure_pair``),
each side jitted with its carry donated and compiled once by ``lower().compile()``, whose wall and CPU seconds
and ``memory_analysis()`` bytes are recorded (``compile``: ``harness.timing.compile_cost`` of each side).

1. ``optimizer``: a step of ``cola.sampling.underdamped`` (BAOAB) and ``overdamped`` (the log-density's gradient
   and the step) against ``cola.cola_ud`` (BAOAB)'s and ``cola.cola_od``'s training step (the mean loss's
   gradient, update, apply_updates) on the 784-1000-10 ReLU MLP, batch 128, under the Circle constraints of the
   paper's Fashion-MNIST model (0.05 on the first kernel, 0.1 on the second), at the same step size, friction
   and key, noise on: the sampler at ``T = 1``, the optimizer at ``tau = 1 / N`` (the same law). The sampler's
   ``grad_estimator`` is ``-N`` times the gradient of the mean cross-entropy (``N = --data-size``).
2. ``chains``: ``--chains`` chains by ``jax.vmap`` over keys and states on the 784-100-10 MLP, batch 128, one
   minibatch per step shared by the chains. A timed call is ``--integration-steps`` gradient evaluations per
   chain (that many steps of cola's samplers or ``blackjax.sgld`` under ``lax.scan``, one ``blackjax.sghmc``
   call with as many integration steps), reported in ms per gradient evaluation and chain: ``underdamped``
   (Circle; and free) against ``sghmc``, ``overdamped`` (free) against ``sgld``, all at ``T = 1``.
3. ``noise``: ``cola.c_cola_ud``'s update (fixed gradients) and training step on the 784-1000-10 MLP against
   SGD-m's (``optax.sgd(h**2, momentum=exp(-gamma h))``), noiseless and with noise from each key
   implementation a user can pass (``jax.random.key(seed, impl=...)``); blackjax's own draw
   (``blackjax.util.generate_gaussian_noise`` over the parameters after a key split, as its SG-MCMC steps draw)
   interleaved with the noisy update, beside cola's draw (the noisy update's median minus the noiseless one's).
   ``key_impls``: per kind, the noise's share of the time and each implementation's saving against threefry.
4. ``collection``: ``memory_analysis()`` of ``cola.sampling.sample_chains`` (compiled, not run) storing
   ``--samples`` thinned positions of each chain on the 784-100-10 MLP (underdamped, Circle): its output bytes
   against what was asked (the samples and the chains' last states), at two thinnings and burn-ins.

Usage::

  OPENBLAS_NUM_THREADS=1 python -m benchmarks.cost.sampler_cost          # the full run
  OPENBLAS_NUM_THREADS=1 python -m benchmarks.cost.sampler_cost --smoke  # tiny models

Writes ``sampler_cost.json`` under ``--out`` after every part (``config.complete``: whether the run finished),
with ``meta``, ``config``, the parts' records (``method_ms``, ``baseline_ms``, ``ratio``, spread, ``compile``),
``noise_draws``, ``key_impls`` and ``targets`` (``name``, ``value``, ``limit``, ``met``).
"""

import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import blackjax
import jax
import jax.numpy as jnp
import optax
from blackjax.util import generate_gaussian_noise

import cola_jax as cola
from benchmarks.cost.step_overhead import build
from benchmarks.cost.step_overhead_models import Model, init_mlp, make_batch, make_loss
from benchmarks.harness.records import provenance, write_json
from benchmarks.harness.timing import (
  compile_cost,
  measure_pair,
  pair_summary,
  speed_output,
  speed_parser,
  started_run,
  target_lines,
  tree_bytes,
)

IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
PARTS = ("optimizer", "chains", "noise", "collection")
TOP_KEYS = ("meta", "config", "optimizer", "chains", "noise", "noise_draws", "key_impls", "collection", "targets")
RECORD_KEYS = ("name", "method", "baseline", "method_ms", "baseline_ms", "ratio", "ratio_of_paired", "compile")
RADIUS = {"Dense_0": 0.05, "Dense_1": 0.1}


def models(smoke: bool) -> tuple[Model, Model]:
  """The paper's 784-1000-10 MLP and the Bayesian experiment's 784-100-10 (tiny stand-ins for --smoke)."""
  if smoke:
    return Model("mlp1000", (48, 64, 10), 16, "softmax", RADIUS), Model("mlp100", (48, 16, 10), 16, "softmax", RADIUS)
  return (
    Model("mlp1000", (784, 1000, 10), 128, "softmax", RADIUS),
    Model("mlp100", (784, 100, 10), 128, "softmax", RADIUS),
  )


def log_density_gradient(loss_fn, data_size: int):
  """blackjax's ``grad_estimator``: the gradient of ``-N`` times the mean loss on the minibatch."""
  return lambda position, batch: jax.tree.map(lambda g: -data_size * g, jax.grad(loss_fn)(position, batch))


def sampler_step(step, batch, step_size: float, temperature: float):
  """``(state, key) -> (state, key)``: one step of a blackjax-shaped sampler, the key split as it goes."""

  def fn(state, key):
    key, sub = jax.random.split(key)
    return step(sub, state, batch, step_size, temperature), key

  return fn


def chains_call(step, batch, step_size: float, temperature: float, steps: int):
  """``(states, keys) -> (states, keys)``: ``steps`` steps of every chain (vmapped), one shared minibatch."""
  vstep = jax.vmap(step, in_axes=(0, 0, None, None, None))

  def one(carry, _):
    states, keys = carry
    keys, subs = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
    return (vstep(subs, states, batch, step_size, temperature), keys), None

  return lambda states, keys: jax.lax.scan(one, (states, keys), length=steps)[0]


def compiled(fn, carry):
  """``fn`` jitted with its carry donated and compiled for ``carry``, with what compiling it cost."""
  return compile_cost(jax.jit(fn, donate_argnums=tuple(range(len(carry)))), *carry)


def fresh(tree):
  """A copy of ``tree``'s arrays: a donated carry must own its buffers."""
  return jax.tree.map(jnp.copy, tree)


def paired(args, name, sides, per_call: int = 1) -> dict:
  """Times two sides ``(label, fn, carry)`` interleaved, ``fn`` compiled once per label: a record of the
  medians in ms per ``per_call`` (gradient evaluations, chains) and the compile costs."""
  exes, costs = [], []
  for label, fn, carry in sides:
    if label not in args.compiled:
      args.compiled[label] = compiled(fn, carry)
    exes.append(args.compiled[label][0])
    costs.append(args.compiled[label][1])
  t_m, t_b = measure_pair(exes, [carry for *_, carry in sides], args.warmup, args.repetitions, args.budget)
  summary = pair_summary(t_m / per_call, t_b / per_call)
  if not args.quiet:
    ms, base, ratio = summary["method_ms"], summary["baseline_ms"], summary["ratio"]
    print(f"{name}: {ms:.4g} ms / {base:.4g} ms = {ratio:.3f}x", file=sys.stderr, flush=True)
  record = {"name": name, "method": sides[0][0], "baseline": sides[1][0], **summary}
  return {**record, "compile": dict(zip(("method", "baseline"), costs))}


def optimizer_pairs(args, model, key) -> list[dict]:
  """Item 1: the samplers' steps against cola_ud's and cola_od's training steps."""
  kp, kb = jax.random.split(key)
  params, batch, loss_fn = init_mlp(kp, model.sizes), make_batch(model, kb), make_loss(model)
  constraints = cola.circle_constraints(model.radius)
  grad_estimator = log_density_gradient(loss_fn, args.data_size)
  noise = lambda: {"temperature": 1.0 / args.data_size, "key": jax.random.key(args.seed)}
  pairs = (  # (name, sampler, step size, optimizer, a new optimizer: its key is donated)
    (
      "underdamped",
      cola.sampling.underdamped(grad_estimator, friction=args.friction, constraints=constraints),
      args.h_ud,
      "cola_ud(BAOAB)",
      lambda: cola.cola_ud(args.h_ud, friction=args.friction, constraints=constraints, splitting="BAOAB", **noise()),
    ),
    (
      "overdamped",
      cola.sampling.overdamped(grad_estimator, constraints=constraints),
      args.h_od,
      "cola_od",
      lambda: cola.cola_od(args.h_od, constraints=constraints, **noise()),
    ),
  )
  records = []
  for name, sampler, h, optimizer, make_tx in pairs:
    carry = (sampler.init(fresh(params)), jax.random.key(args.seed))
    sides = (
      (name, sampler_step(sampler.step, batch, h, 1.0), carry),
      (optimizer, *build("step", make_tx(), loss_fn, params, None, batch)),
    )
    records.append(paired(args, f"{name} / {optimizer} step", sides))
  return records


def chain_pairs(args, model, key) -> list[dict]:
  """Item 2: many chains by vmap, cola's samplers against blackjax's sghmc and sgld, per gradient and chain."""
  kp, kb = jax.random.split(key)
  batch, loss_fn = make_batch(model, kb), make_loss(model)
  positions = jax.vmap(lambda k: init_mlp(k, model.sizes))(jax.random.split(kp, args.chains))
  grad_estimator = log_density_gradient(loss_fn, args.data_size)
  L, circle = args.integration_steps, cola.circle_constraints(model.radius)
  samplers = {  # name: (sampler, step size, its steps per call)
    "underdamped Circle": (
      cola.sampling.underdamped(grad_estimator, friction=args.friction, constraints=circle),
      args.h_ud,
      L,
    ),
    "underdamped free": (cola.sampling.underdamped(grad_estimator, friction=args.friction), args.h_ud, L),
    "overdamped free": (cola.sampling.overdamped(grad_estimator), args.h_od, L),
    "blackjax.sghmc": (blackjax.sghmc(grad_estimator, num_integration_steps=L, alpha=args.friction), args.h_ud, 1),
    "blackjax.sgld": (blackjax.sgld(grad_estimator), args.h_od, L),
  }

  def side(name):
    sampler, h, steps = samplers[name]
    keys = jax.random.split(jax.random.key(args.seed), args.chains)
    return name, chains_call(sampler.step, batch, h, 1.0, steps), (jax.vmap(sampler.init)(fresh(positions)), keys)

  records = []
  position_bytes = tree_bytes(positions) // args.chains
  for method, baseline in (
    ("underdamped Circle", "blackjax.sghmc"),
    ("underdamped free", "blackjax.sghmc"),
    ("overdamped free", "blackjax.sgld"),
  ):
    name = f"{method} / {baseline} per gradient and chain"
    record = paired(args, name, (side(method), side(baseline)), per_call=L * args.chains)
    records.append({**record, "gradients_per_call": L, "chains": args.chains, "position_bytes": position_bytes})
  return records


def noise_pairs(args, model, key) -> dict:
  """Item 3: c_cola_ud's update and step against SGD-m's, noiseless and per key implementation; the draws."""
  kp, kb = jax.random.split(key)
  params, batch, loss_fn = init_mlp(kp, model.sizes), make_batch(model, kb), make_loss(model)
  grads = jax.grad(loss_fn)(params, batch)
  lr, momentum = cola.langevin_to_sgd_momentum(args.h_noise, args.friction)

  def c_cola_ud(kind, impl):
    noise = {} if impl is None else {"temperature": args.tau, "key": jax.random.key(args.seed, impl=impl)}
    tx = cola.c_cola_ud(args.h_noise, friction=args.friction, radius=model.radius, **noise)
    return (f"c_cola_ud {kind}, {impl or 'noiseless'}", *build(kind, tx, loss_fn, params, grads, batch))

  def draw(key, previous):
    key, sub = jax.random.split(key)
    return key, generate_gaussian_noise(sub, previous)

  records, draws = [], []
  for impl in (None, *args.impls):
    for kind in ("update", "step"):
      sgd_m = (
        f"sgd({lr:.4g}, momentum={momentum:.4g}) {kind}",
        *build(kind, optax.sgd(lr, momentum=momentum), loss_fn, params, grads, batch),
      )
      record = paired(args, f"c_cola_ud {impl or 'noiseless'} / SGD-m {kind}", (c_cola_ud(kind, impl), sgd_m))
      records.append({**record, "kind": kind, "impl": impl})
    if impl is not None:
      blackjax_side = (
        f"blackjax generate_gaussian_noise, {impl}",
        draw,
        (jax.random.key(args.seed, impl=impl), jax.tree.map(jnp.zeros_like, params)),
      )
      record = paired(
        args, f"blackjax draw / c_cola_ud noisy update, {impl}", (blackjax_side, c_cola_ud("update", impl))
      )
      update_ms = {r["impl"]: r["method_ms"] for r in records if r["kind"] == "update"}
      draws.append(
        {
          **record,
          "impl": impl,
          "normals": sum(x.size for x in jax.tree.leaves(params)),
          "blackjax_draw_ms": record["method_ms"],
          "cola_draw_ms": update_ms[impl] - update_ms[None],
        }
      )
  return {"noise": records, "noise_draws": draws, "key_impls": key_impls(records)}


def collection_memory(args, model, key) -> list[dict]:
  """Item 4: ``memory_analysis()`` of ``sample_chain`` / ``sample_chains`` (compiled, not run) storing k samples.

  ``asked_bytes``: the samples, the last states and the step count; ``tuple_bytes``: XLA's table of the
  output tuple, 8 bytes per array; ``excess_bytes``: the output's bytes beyond both.
  """
  kp, kb = jax.random.split(key)
  batch, grad_estimator = make_batch(model, kb), log_density_gradient(make_loss(model), args.data_size)
  positions = jax.vmap(lambda k: init_mlp(k, model.sizes))(jax.random.split(kp, args.chains))
  circle = cola.circle_constraints(model.radius)
  sampler = cola.sampling.underdamped(grad_estimator, friction=args.friction, constraints=circle)
  states, keys = jax.vmap(sampler.init)(positions), jax.random.split(jax.random.key(args.seed), args.chains)
  position_bytes, state_bytes = tree_bytes(positions) // args.chains, tree_bytes(states) // args.chains
  one, h, k, c = jax.tree.map(lambda x: x[0], (states, keys)), args.h_ud, args.samples, args.chains
  rows = []
  for chains, samples, thinning, burnin in ((1, k, 1, 0), (c, k, 1, 0), (c, k, 10, 100), (c, 2 * k, 1, 0)):
    collect = cola.sampling.sample_chain if chains == 1 else cola.sampling.sample_chains
    fn = jax.jit(
      lambda s, k: collect(
        sampler.step, s, k, batch, num_samples=samples, step_size=h, thinning=thinning, num_burnin=burnin
      )
    )
    carry = one if chains == 1 else (states, keys)
    cost = compile_cost(fn, *carry)[1]
    asked = chains * (samples * position_bytes + state_bytes) + 4  # the samples, the last states, num_steps
    tuple_bytes = 8 * len(jax.tree.leaves(jax.eval_shape(fn, *carry)))
    row = dict(chains=chains, num_samples=samples, thinning=thinning, num_burnin=burnin, asked_bytes=asked)
    excess = cost["output_bytes"] - asked - tuple_bytes
    rows.append({**row, "tuple_bytes": tuple_bytes, "excess_bytes": excess, "position_bytes": position_bytes, **cost})
  return rows


def key_impls(records) -> list[dict]:
  """Per kind and key implementation: the share of the step that is noise and the saving against threefry."""
  ratio = {(r["impl"], r["kind"]): r["ratio"] for r in records}
  rows = []
  for (impl, kind), value in ratio.items():
    saving = 1 - value / ratio[("threefry2x32", kind)]
    row = dict(impl=impl, kind=kind, ratio_to_sgd_m=value, noise_share=1 - ratio[(None, kind)] / value)
    rows += [] if impl is None else [{**row, "saving_vs_threefry": saving, "buys_over_10_percent": saving > 0.1}]
  return rows


def targets_from(report) -> list[dict]:
  """The issue's targets: time ratios (cola's over the baseline's) and the collection's bytes beyond what was asked."""
  targets = [(r["name"], r["ratio"], 1.05) for r in report["optimizer"]]
  targets += [(r["name"], r["ratio"], 1.0) for r in report["chains"] if "free / blackjax.sghmc" not in r["name"]]
  if report["collection"]:
    excess = max(r["excess_bytes"] for r in report["collection"])
    targets.append(("collection output bytes beyond the samples, last states and tuple table", excess, 0))
  return [dict(name=n, value=v, limit=lim, met=None if v is None else bool(v <= lim)) for n, v, lim in targets]


def table(report) -> str:
  rows = [f"{'measurement':62} {'method ms':>10} {'base ms':>10} {'ratio':>7} {'compile s':>10} {'temp MB':>8}"]
  for r in report["optimizer"] + report["chains"] + report["noise"] + report["noise_draws"]:
    c = r["compile"]["method"]
    temp = "n/a" if c["temp_bytes"] is None else f"{c['temp_bytes'] / 2**20:.2f}"
    rows.append(
      f"{r['name']:62} {r['method_ms']:10.4g} {r['baseline_ms']:10.4g} {r['ratio']:7.3f} "
      f"{c['compile_s']:10.2f} {temp:>8}"
    )
  rows += [
    f"draw of {d['normals']} normals, {d['impl']}: blackjax {d['blackjax_draw_ms']:.4g} ms, "
    f"cola {d['cola_draw_ms']:.4g} ms"
    for d in report["noise_draws"]
  ]
  rows += [
    f"{k['impl']:>12} {k['kind']:6}: {k['ratio_to_sgd_m']:.2f}x SGD-m, noise {100 * k['noise_share']:.0f} %, "
    f"saves {100 * k['saving_vs_threefry']:.0f} % of threefry's{'  > 10 %' * k['buys_over_10_percent']}"
    for k in report["key_impls"]
  ]
  rows += [
    f"{r['chains']} chains x {r['num_samples']} samples, thinning {r['thinning']}, burn-in {r['num_burnin']}: "
    f"output {r['output_bytes']} B = asked {r['asked_bytes']} + tuple {r['tuple_bytes']} + {r['excess_bytes']}, "
    f"temp {r['temp_bytes']} B"
    for r in report["collection"]
  ]
  return "\n".join(rows + target_lines(report["targets"], lambda t: f"{t['value']:.3f}"))


def parse_args(argv=None):
  p = speed_parser(
    __doc__, "tiny models, a few repetitions: a check that runs in seconds", repetitions=400, budget_s=12
  )
  p.add_argument("--warmup", type=int, default=5)
  p.add_argument("--h-ud", type=float, default=1e-3, help="underdamped step size h (samplers and cola_ud)")
  p.add_argument("--h-od", type=float, default=1e-5, help="overdamped step size h (samplers and cola_od)")
  p.add_argument("--h-noise", type=float, default=0.3, help="c_cola_ud's step h against SGD-m (step_overhead's)")
  p.add_argument("--tau", type=float, default=1e-6, help="c_cola_ud's temperature with noise (step_overhead's)")
  p.add_argument("--friction", type=float, default=1.0)
  p.add_argument("--data-size", type=int, default=10000, help="N: the log-density is -N times the mean loss")
  p.add_argument("--chains", type=int, default=16)
  p.add_argument("--integration-steps", type=int, default=10, help="gradient evaluations per timed chains call")
  p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS, help="PRNG key implementations")
  p.add_argument("--samples", type=int, default=100, help="samples per chain collected by sample_chains")
  p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
  p.add_argument("--quiet", action="store_true", help="no line per measurement on stderr")
  args = p.parse_args(argv)
  if "threefry2x32" not in args.impls:
    p.error("--impls: threefry2x32 is the reference the others are compared with")
  return args


def main(argv=None) -> dict:
  argv, args, start = started_run(parse_args, argv)
  if args.smoke:
    args.repetitions, args.warmup, args.budget = min(args.repetitions, 5), min(args.warmup, 1), min(args.budget, 1.0)
    args.samples = min(args.samples, 10)
  args.out = speed_output(args, "sampler_cost")
  large, small = models(args.smoke)
  config = {
    **{name: value for name, value in vars(args).items() if name != "out"},
    "models": {m.name: {"sizes": list(m.sizes), "batch": m.batch, "radius": m.radius} for m in (large, small)},
    "timing": "median over interleaved repetitions after warm-up; jit with the carry donated, compiled once; "
    "jax.block_until_ready after every call",
  }
  report: dict = {key: [] for key in TOP_KEYS[2:-1]}
  args.compiled = {}  # label: (executable, compile cost), each program compiled once
  path = os.path.join(args.out, "sampler_cost.json")

  def written(complete=False) -> dict:
    report.update(meta=provenance(argv, start, packages=("blackjax",)), config={**config, "complete": complete})
    report["targets"] = targets_from(report)
    write_json(path, {key: report[key] for key in TOP_KEYS})
    return report

  key = jax.random.key(args.seed)
  measure = {"optimizer": optimizer_pairs, "chains": chain_pairs, "noise": noise_pairs, "collection": collection_memory}
  for i, part in enumerate(PARTS):
    if part in args.parts:
      measured = measure[part](args, small if part in ("chains", "collection") else large, jax.random.fold_in(key, i))
      report.update(measured if part == "noise" else {part: measured})
      written()
  written(complete=True)
  print(table(report))
  print(f"\nwrote {path}")
  return report


if __name__ == "__main__":
  main()
