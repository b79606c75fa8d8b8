"""A newcomer's first run: a Flax linen MLP 1-64-64-1 fitted for 300 full-batch steps, optax.sgd against the
o-CoLA-ud spellings a user coming from optax writes (issue 37).

- ``sgd``: ``optax.sgd(1e-3, momentum=0.9)``, the baseline;
- ``friction``: ``o_cola_ud(1e-3, friction=0.9)``, friction misread as a momentum coefficient
  (it is SGD-m with learning rate 1e-6 and momentum 0.9991);
- ``momentum``: ``o_cola_ud(1e-3, momentum=0.9)``, optax's settings;
- ``every_kernel``: the same with the default mask: every kernel constrained, the (64, 1) output kernel
  made a unit vector (a UserWarning names it).

``friction`` and ``momentum`` constrain the hidden kernel only (the paper's choice).

Every cola run starts from ``project_params``. The final mean squared error, mean and std over seeds.

  python -m benchmarks.comparisons.newcomer --out results/comparisons
"""

import sys
import time
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import cola_jax as cola
from benchmarks.harness import cli, records, report

LEARNING_RATE, MOMENTUM = 1e-3, 0.9


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(64)(x))
    x = nn.tanh(nn.Dense(64)(x))
    return nn.Dense(1)(x)


def _hidden_kernel(params):
  """The paper's choice: the hidden (64, 64) kernel orthonormal, the input and output layers free."""
  return {
    "params": {
      name: {"kernel": cola.Orthogonal() if name == "Dense_1" else None, "bias": None} for name in params["params"]
    }
  }


METHODS = {  # name -> (transformation, its constraints); None: unconstrained
  "sgd": lambda: (optax.sgd(LEARNING_RATE, momentum=MOMENTUM), None),
  "friction": lambda: (cola.o_cola_ud(LEARNING_RATE, friction=MOMENTUM, constraints=_hidden_kernel), _hidden_kernel),
  "momentum": lambda: (cola.o_cola_ud(LEARNING_RATE, momentum=MOMENTUM, constraints=_hidden_kernel), _hidden_kernel),
  "every_kernel": lambda: (cola.o_cola_ud(LEARNING_RATE, momentum=MOMENTUM), cola.orthogonal_constraints()),
}


def _data():
  x = jnp.linspace(-1.0, 1.0, 256)[:, None]
  return x, jnp.sin(3.0 * x)


def final_loss(method: str, seed: int, steps: int) -> float:
  """The mean squared error after ``steps`` full-batch steps of ``method`` from seed ``seed``'s initialisation."""
  x, y = _data()
  model = MLP()
  params = model.init(jax.random.key(seed), x)
  tx, constraints = METHODS[method]()
  if constraints is not None:
    params = cola.project_params(params, constraints)
  loss = lambda p: jnp.mean((model.apply(p, x) - y) ** 2)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # the default mask's warning: its effect is what is measured
    state = tx.init(params)

  @jax.jit
  def step(params, state):
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(steps):
    params, state = step(params, state)
  return float(loss(params))


def main(argv):
  p = cli.parser(__doc__.splitlines()[0], seeds=3, epochs=300, out="results/comparisons", smoke="2 seeds, 5 steps")
  args = p.parse_args(argv)
  if args.smoke:
    args.seeds, args.epochs = 2, 5
  started = time.perf_counter()
  losses = {m: [final_loss(m, seed, args.epochs) for seed in range(args.seeds)] for m in METHODS}
  rows = [[m, report.pm(v, digits=4)] for m, v in losses.items()]
  print(report.table(rows, ["method", f"MSE after {args.epochs} steps"]))
  config = {"learning_rate": LEARNING_RATE, "momentum": MOMENTUM, "steps": args.epochs, "seeds": args.seeds}
  records.write_report(
    report.output_dir(args.out, "newcomer"), "newcomer.json", argv, started, config, final_loss=losses
  )


if __name__ == "__main__":
  main(sys.argv[1:])
