"""The paper's spiral experiment (Figs. 2-3): o-CoLA-od against SGD on deep MLPs.

Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of Neural
Networks* (OPT2020), Sec. 4 and Appendix C. The protocol:

* data: the 4-turn two-class spiral, 500 training and 1000 test points, one
  draw (``--data-seed``) shared by every method and seed (paired comparison);
* model: ``p`` hidden layers of 100 ReLU units, 2 inputs, 1 logit; binary
  cross-entropy, minibatches of 25 reshuffled every epoch, step ``h = 0.1``;
* methods: ``sgd`` (PyTorch's default init, which the paper used),
  ``sgd_orth`` (every kernel orthogonal at init), ``ocola_od`` (the ``p - 1``
  hidden-to-hidden kernels orthogonal and kept orthonormal by o-CoLA-od at
  ``tau = 0``; input and output layers free) and ``ocola_od_tau``
  (``tau = 1e-6``, Fig. 3). At ``p = 1`` nothing is constrained and
  ``ocola_od`` is ``sgd``.

Methods that differ only in their init (the SGDs) or their temperature (the
o-CoLA-ods) share one compiled training step: their seeds are members of one
vmapped batch. Usage::

    python -m benchmarks.paper.spiral --out results/paper  # 10 seeds, depths 1-10
    python -m benchmarks.paper.spiral --smoke              # seconds, into a temporary folder
    python -m benchmarks.paper.spiral --depths 2,4,8 --epochs 500 --seeds 5 --out /tmp/spiral
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import cola_jax as cola
from benchmarks.harness import cli, data, models, report, sweep, train

SCHEMA_VERSION = 2
METHODS = {
  "sgd": "SGD, standard (PyTorch) init",
  "sgd_orth": "SGD, orthogonal init",
  "ocola_od": "o-CoLA-od, tau = 0",
  "ocola_od_tau": "o-CoLA-od, tau = 1e-6",
}
METHOD_ORDER = tuple(METHODS)
GROUPS = {"sgd": ("sgd", "sgd_orth"), "ocola": ("ocola_od", "ocola_od_tau")}
DEFAULT_EPOCHS = 60
SMOKE = {"seeds": 2, "depths": [1, 3], "epochs": 4}
LAST_RUN_PARAMS: dict = {}  # main() leaves LAST_RUN_PARAMS[method][depth] here (leading seed axis)


def hidden_kernels(depth: int):
  """The hidden-to-hidden kernels ``layer1`` .. ``layer{depth-1}`` orthogonal, every other leaf free."""
  rules = [(f"^layer{i}/kernel$", cola.Orthogonal()) for i in range(1, depth)]
  return cola.path_constraints(rules)


def model(depth: int, orthogonal_init, width: int = 100) -> models.MLP:
  """``depth`` hidden ReLU layers of ``width``; layer ``i``'s kernel orthogonal if ``orthogonal_init(i)``."""
  ortho = jax.nn.initializers.orthogonal()
  return models.MLP((width,) * depth + (1,), kernel_init=lambda i: ortho if orthogonal_init(i) else None)


def group_run(
  group: str,
  names: Sequence[str],
  depth: int,
  dataset,
  *,
  seeds: int,
  eval_every: int,
  learning_rate: float = 0.1,
  temperature: float = 1e-6,
  width: int = 100,
) -> train.Run:
  """The run of ``names`` (all of ``GROUPS[group]``), ``seeds`` seeds each, at ``depth``: member
  ``j * seeds + s`` is seed ``s`` of ``names[j]``."""
  standard, orthogonal = (model(depth, lambda i, o=o: o, width) for o in (False, True))
  constrained = model(depth, lambda i: 0 < i < depth, width)
  constraints = hidden_kernels(depth)
  x0 = dataset.x_train[:1]

  def init_params(key, member):
    if group == "ocola":
      return constrained.init(key, x0)["params"]
    return jax.tree.map(
      lambda o, s: jnp.where(member["orthogonal"], o, s),
      orthogonal.init(key, x0)["params"],
      standard.init(key, x0)["params"],
    )

  noisy = group == "ocola" and "ocola_od_tau" in names

  def make_tx(member, noise_key):
    if group == "sgd":
      return optax.sgd(learning_rate)
    if not noisy:  # exactly tau = 0: no noise drawn at all
      return cola.cola_od(learning_rate, constraints=constraints)
    return cola.cola_od(learning_rate, constraints=constraints, temperature=member["temperature"], key=noise_key)

  def probes(params):
    kernels = [params[f"layer{i}"]["kernel"] for i in range(1, depth)]
    defects = [jnp.max(jnp.abs(jnp.matmul(k.T, k, precision="highest") - jnp.eye(k.shape[1]))) for k in kernels]
    return {"max_orthogonality_defect": jnp.max(jnp.stack(defects)) if defects else jnp.zeros(())}

  members = {
    "seed": np.tile(np.arange(seeds), len(names)),
    "orthogonal": np.repeat([n == "sgd_orth" for n in names], seeds),
    "temperature": np.repeat([temperature if n == "ocola_od_tau" else 0.0 for n in names], seeds).astype(np.float32),
  }
  return train.Run(
    init_params=init_params,
    apply_fn=lambda p, x: standard.apply({"params": p}, x),
    make_tx=make_tx,
    objective=train.BINARY,
    data=dataset,
    members=members,
    batch_size=25,
    eval_every=eval_every,
    probes=probes,
  )


def parse_args(argv):
  p = cli.parser(
    "The paper's spiral experiment: o-CoLA-od vs SGD on MLPs with 1..10 hidden layers "
    "of 100 ReLU units (all seeds trained at once with jax.vmap).",
    seeds=10,
    epochs=DEFAULT_EPOCHS,
    out="results/paper/",
    smoke=f"{SMOKE['seeds']} seeds, depths {SMOKE['depths']}, {SMOKE['epochs']} epochs",
  )
  p.add_argument("--depths", type=cli.int_list, default="1-10", help='hidden-layer counts: "1-10", "1,3,5", "1-3,8"')
  p.add_argument(
    "--methods",
    type=cli.choices(METHOD_ORDER),
    default=",".join(METHOD_ORDER),
    help=f"comma list from {', '.join(METHOD_ORDER)}",
  )
  p.add_argument("--temperature", type=float, default=1e-6, help="tau of ocola_od_tau")
  p.add_argument("--learning-rate", type=float, default=0.1, help="h of every method")
  p.add_argument("--data-seed", type=int, default=0, help="seed of the (shared) data set")
  cli.merge_flag(
    p, "train nothing: join the spiral.json files of runs of one protocol that split its methods or depths"
  )
  args = p.parse_args(argv)
  if args.smoke:
    args.seeds, args.depths, args.epochs = SMOKE["seeds"], SMOKE["depths"], SMOKE["epochs"]
  if args.seeds < 1:
    p.error("--seeds must be positive")
  args.eval_every = cli.eval_every(p, args.epochs, args.eval_every)
  if args.out is None:
    args.out = None if args.smoke else "results/paper/"
  return args


def write(out: dict, out_dir: str) -> None:
  """The JSON (with its summary), the PNG and the printed table of a sweep."""
  config, results = out["config"], out["results"]
  out["summary"] = {
    m: {str(d): report.mean_std_fields(results[m][str(d)], ("test_accuracy", "train_loss")) for d in config["depths"]}
    for m in config["methods"]
  }
  json_path, png_path = os.path.join(out_dir, "spiral.json"), os.path.join(out_dir, "spiral.png")
  report.write_json(json_path, out)
  sweep.plot(
    results,
    config,
    METHODS,
    png_path,
    f"4-turn spiral, 500 train / 1000 test points, batch 25, h = {config['learning_rate']}, 100-unit ReLU layers",
  )
  rows = [
    [
      METHODS[m],
      d,
      report.pm(results[m][str(d)]["test_accuracy"], 100, 2),
      report.pm(results[m][str(d)]["train_loss"], 1, 4),
    ]
    for m in config["methods"]
    for d in config["depths"]
  ]
  print(report.table(rows, ["method", "depth", "test acc (%)", "train loss"]))
  print(f"wall time {out['wall_time_s']:.1f} s; wrote {json_path} and {png_path}")


def main(argv: Sequence[str] | None = None) -> dict:
  """Runs the sweep; writes ``spiral.json`` and ``spiral.png`` under ``--out``; returns the JSON's dict."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  out_dir = report.output_dir(args.out, "spiral")
  if args.merge:
    out = sweep.merge(args.merge, argv, METHODS)
    write(out, out_dir)
    return out
  start = time.perf_counter()
  dataset = data.spiral(seed=args.data_seed)
  groups = {g: [m for m in members if m in args.methods] for g, members in GROUPS.items()}
  groups = {g: names for g, names in groups.items() if names}
  bar = report.progress(len(args.depths) * len(groups) * (args.epochs // args.eval_every), args.quiet)
  results = {m: {} for m in args.methods}
  LAST_RUN_PARAMS.clear()
  for depth in args.depths:
    for group, names in groups.items():
      run = group_run(
        group,
        names,
        depth,
        dataset,
        seeds=args.seeds,
        eval_every=args.eval_every,
        learning_rate=args.learning_rate,
        temperature=args.temperature,
      )
      train.train({f"p={depth} {group}": run}, args.epochs, progress=bar)
      for j, name in enumerate(names):
        rows = slice(j * args.seeds, (j + 1) * args.seeds)
        history = run.rows(rows)
        entry = report.entry(history, finals=("epoch_mean_batch_loss",))
        entry["last_epoch_mean_batch_loss"] = entry.pop("epoch_mean_batch_loss")
        entry.update(group=names, group_compile_time_s=run.compile_s, group_run_time_s=run.run_s)
        if group == "ocola":
          entry["max_orthogonality_defect"] = report.finite_list(history["max_orthogonality_defect"][-1])
          entry["projection_fallbacks"] = [int(v) for v in history["projection_fallbacks"][-1]]
        results[name][str(depth)] = entry
        LAST_RUN_PARAMS.setdefault(name, {})[depth] = jax.tree.map(lambda a, r=rows: a[r], run.params)
        bar.write(
          f"p={depth:2d} {name:<13} test acc {report.pm(entry['test_accuracy'], 100, 2)} %  "
          f"train loss {report.pm(entry['train_loss'])}"
        )
      bar.write(f"      ({'+'.join(names)}: compile {run.compile_s:.1f} s, run {run.run_s:.1f} s)")
  bar.close()
  config = {
    "seeds": args.seeds,
    "depths": list(args.depths),
    "epochs": args.epochs,
    "methods": list(args.methods),
    "width": 100,
    "n_train": 500,
    "n_test": 1000,
    "batch_size": 25,
    "steps_per_epoch": 20,
    "learning_rate": args.learning_rate,
    "temperature": args.temperature,
    "data_seed": args.data_seed,
    "eval_every": args.eval_every,
  }
  out = {
    "schema_version": SCHEMA_VERSION,
    "experiment": "spiral (Leimkuhler et al., Constraint-Based Regularization of Neural Networks, Figs. 2-3)",
    "config": config,
    "data": dataset.info,
    "methods": {m: METHODS[m] for m in args.methods},
    "depths": list(args.depths),
    "seeds": list(range(args.seeds)),
    "results": results,
    **report.provenance(argv, start, packages=("flax",)),
  }
  write(out, out_dir)
  return out


if __name__ == "__main__":
  main()
