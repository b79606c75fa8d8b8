"""The README and the documentation site (docs/): their examples run and say what they show, their numbers
come from committed results, and the API reference has every public name.

Every ```python block of a page runs, top to bottom and page by page, in one fresh namespace per page,
as a reader would paste them into a fresh interpreter, and none makes cola_jax warn. The claims a block's
comments make are checked on the page's namespace after that block (``CLAIMS``). The site itself is built by ``.ci/run``
(``python -m sphinx -W``).
"""

import importlib.util
import json
import pathlib
import re
import runpy
import sys

import jax
import jax.numpy as jnp
import pytest
from _said import cola_warnings

import cola_jax

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README, *sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.relative_to(DOCS).parts)]
REPOSITORY = "https://github.com/cola-jax/cola_jax"


def _blocks(page):
  return re.findall(r"^```python\n(.*?)^```$", page.read_text(), flags=re.DOTALL | re.MULTILINE)


def _orthonormal_kernel(ns):
  assert ns["residuals"]["bias"] is None
  assert ns["residuals"]["kernel"] < 1e-6


def _linen(ns):
  residuals = ns["residuals"]
  assert residuals["conv"]["kernel"] < 1e-5 and residuals["dense"]["kernel"] < 1e-5
  assert int(ns["state"].step) == 1


def _nnx(ns):
  residuals = ns["nnx_residuals"]
  assert residuals["conv"]["kernel"] < 1e-5 and residuals["dense"]["kernel"] < 1e-5


def _equinox(ns):
  residuals = ns["eqx_residuals"].layers
  assert [r.weight < 1e-6 for r in residuals[:3]] == [True] * 3 and residuals[3].weight is None


def _seeds(ns):
  kernels = ns["params"]["kernel"]
  assert kernels.shape == (10, 8, 4)
  assert float(jnp.max(jnp.abs(kernels))) <= 0.05 * (1 + 1e-6)
  assert len({bytes(k) for k in jax.device_get(kernels)}) == 10  # each seed its own run


def _sharded(ns):
  assert ns["opt_state"].constraint_states["kernel"].slack.sharding == ns["params"]["kernel"].sharding


def _state_shardings(ns):
  shardings, state_shardings = ns["shardings"], ns["state_shardings"]
  assert state_shardings.momentum == shardings  # the momenta are copies of the parameters
  assert state_shardings.constraint_states == state_shardings.count == ns["replicated"]
  assert ns["opt_state"].momentum["kernel"].sharding == shardings["kernel"]


def _kernels_bounded_rest_on_adam(ns):
  params = {
    "embed": {"embedding": jnp.full((5, 4), 0.5)},
    "hidden": {"kernel": jnp.full((4, 4), 0.05), "bias": jnp.zeros(4)},
    "output_layer": {"kernel": jnp.full((4, 3), 0.05), "bias": jnp.zeros(3)},
  }
  with cola_warnings() as said:  # the rule names the leaves: nothing to warn about when copied
    state = ns["tx"].init(params)
    updates, state = ns["tx"].update(jax.tree.map(lambda p: jnp.full_like(p, -10.0), params), state, params)
  assert not said, said[0].message
  new = jax.tree.map(lambda p, u: p + u, params, updates)
  for layer in ("hidden", "output_layer"):  # SGD-m's step of 0.9 would leave [-0.1, 0.1]
    kernel = new[layer]["kernel"]
    assert float(jnp.max(jnp.abs(kernel))) <= 0.1 * (1 + 1e-6) and float(jnp.min(kernel)) > 0.05, layer
  for leaf in (new["embed"]["embedding"] - 0.5, new["hidden"]["bias"], new["output_layer"]["bias"]):
    assert float(jnp.max(jnp.abs(leaf - 1e-3))) < 1e-6  # Adam's first step, -1e-3 sign(g)


def _choosing(ns):
  assert ns["sgd_learning_rate"] == pytest.approx(1e-3) and ns["momentum"] == pytest.approx(0.9)


def _hidden_orthonormal_rest_adam(ns):
  params = ns["params"]
  for name in ("Dense_1", "Dense_2"):
    kernel = params[name]["kernel"]
    assert float(jnp.max(jnp.abs(kernel.T @ kernel - jnp.eye(4)))) < 1e-5
  # Adam's first step is -lr * sign(g) on every other leaf.
  assert float(jnp.max(jnp.abs(params["Dense_0"]["kernel"] - (0.5 - 1e-3)))) < 1e-6
  assert float(jnp.max(jnp.abs(params["Dense_3"]["bias"] + 1e-3))) < 1e-6


def _attention_per_head(ns):
  attention = ns["model"].attention
  for name in ("query", "key", "value"):  # (features, heads, head_dim): W^T W = I per head
    kernel = getattr(attention, name).kernel[...]
    gram = jnp.einsum("fhd,fhe->hde", kernel, kernel)
    assert float(jnp.max(jnp.abs(gram - jnp.eye(kernel.shape[2])))) < 1e-5, name
  out = attention.out.kernel[...]  # (heads, head_dim, features): W W^T = I per head
  gram = jnp.einsum("hdf,hef->hde", out, out)
  assert float(jnp.max(jnp.abs(gram - jnp.eye(out.shape[1])))) < 1e-5


def _equinox_attention_per_head(ns):
  params, heads = ns["params"], ns["heads"]
  for name in ("query_proj", "key_proj", "value_proj"):  # (heads * head_dim, features): B B^T = I per head
    blocks = getattr(params, name).weight.reshape(heads, -1, ns["width"])
    gram = jnp.einsum("hdf,hef->hde", blocks, blocks)
    assert float(jnp.max(jnp.abs(gram - jnp.eye(blocks.shape[1])))) < 1e-5, name
    assert float(jnp.max(jnp.abs(blocks[0] @ blocks[1].T))) > 0.05, name  # the heads not orthogonal to each other
  out = params.output_proj.weight.reshape(ns["width"], heads, -1)  # (features, heads, head_dim): B^T B = I per head
  gram = jnp.einsum("fhd,fhe->hde", out, out)
  assert float(jnp.max(jnp.abs(gram - jnp.eye(out.shape[2])))) < 1e-5
  residuals = cola_jax.constraint_residuals(params, ns["opt_state"])
  assert residuals.query_proj.bias is None and residuals.output_proj.bias is None  # the biases free


def _implicit(ns):
  assert bool(ns["opt_state"].constraint_states["kernel"].converged)


def _custom_constraint(ns):
  # check_constraint's rounding bound for the 4 x 3 kernel: each update lands on the set, then params + updates rounds.
  bound = 2 * (12 + 2) * float(jnp.finfo(jnp.float32).eps)
  for residuals in (ns["ud_residuals"], ns["adam_residuals"]):
    assert residuals["bias"] is None and float(residuals["kernel"]) <= bound
  for kernel in (ns["ud_params"]["kernel"], ns["adam_params"]["kernel"]):
    assert float(jnp.max(jnp.abs(kernel.sum(axis=0)))) <= bound * float(jnp.max(jnp.abs(kernel).sum(axis=0)))
  start_loss = float(ns["start_loss"])
  assert float(ns["ud_loss"]) < 1e-3 * start_loss and float(ns["adam_loss"]) < 1e-3 * start_loss


def _simplex(ns):
  # check_constraint's rounding bound for the 2 x 4 leaf, then params + updates.
  bound = 2 * (8 + 2) * float(jnp.finfo(jnp.float32).eps)
  target = ns["probabilities"]
  for params, residual in ns["simplex_fits"]:
    w = params["w"]
    assert float(residual) <= bound and bool(jnp.all(w >= 0))
    assert float(jnp.max(jnp.abs(w.sum(axis=-1) - 1))) <= bound
    assert float(jnp.max(jnp.abs(w - target))) < 2e-3  # the one-hot row left its corner


def _ball(ns):
  bound = 2 * (8 + 2) * float(jnp.finfo(jnp.float32).eps)  # the 2 x 3 leaf and its two slacks
  target = ns["ball_target"]
  nearest = target * jnp.minimum(1, 0.5 / jnp.linalg.norm(target, axis=-1, keepdims=True))
  for params, residual in ns["ball_fits"]:
    assert float(residual) <= bound
    assert float(jnp.max(jnp.abs(params["w"] - nearest))) < 2e-3


def _from_sgd_momentum(ns):
  assert ns["h"] == pytest.approx(0.1**0.5) and ns["gamma"] == pytest.approx(-jnp.log(0.9) / 0.1**0.5)


def _sampling(ns):
  samples = ns["chain"].samples
  assert {leaf.shape[0] for leaf in jax.tree.leaves(samples)} == {50}
  for layer in samples.values():  # every kernel entry on its circle, |w| <= 0.5
    assert float(jnp.max(jnp.abs(layer["kernel"]))) <= 0.5 * (1 + 1e-6)
  assert int(ns["chain"].num_steps) == 200 + 50 * 10


def _sampling_resumed(ns):
  assert int(ns["more"].num_steps) == int(ns["chain"].num_steps) + 50 * 10


def _sampling_observed(ns):
  assert ns["observed"].samples.shape == (200,)


def _blackjax_sgld(ns):
  log_probs = ns["free_log_probs"]
  assert log_probs.shape == (512, 2)
  assert float(jnp.max(jnp.abs(jax.nn.logsumexp(log_probs, axis=-1)))) < 1e-5  # normalised probabilities
  assert jax.tree.leaves(ns["free"].samples)[0].shape[:2] == (4, 100)


CLAIMS = {  # a line of a block -> the check of what its comments say
  "residuals = cola.constraint_residuals(params, state)": _orthonormal_kernel,
  "residuals = cola.constraint_residuals(state.params, state.opt_state)": _linen,
  "nnx_residuals = cola.constraint_residuals(": _nnx,
  "eqx_residuals = cola.constraint_residuals(params, opt_state)": _equinox,
  "params, states = train_seeds(": _seeds,
  "params = jax.device_put(params, shardings)": _sharded,
  "state_shardings = optax.tree.map_params(": _state_shardings,
  "tx = cola.c_cola_ud(0.3, friction=1.0, constraints=kernels, free=optax.adam(1e-3))": _kernels_bounded_rest_on_adam,
  "sgd_learning_rate, momentum = cola.langevin_to_sgd_momentum(h, gamma)": _choosing,
  "# hidden kernels orthonormal, the rest by Adam": _hidden_orthonormal_rest_adam,
  "opt_state.constraint_states['kernel'].converged": _implicit,
  "query = model.attention.query.kernel[...]": _attention_per_head,
  "eqx_query = params.query_proj.weight.reshape(heads, 8, width)": _equinox_attention_per_head,
  "h, gamma = cola.sgd_momentum_to_langevin(0.1, 0.9)": _from_sgd_momentum,
  "ud_loss, adam_loss = loss(ud_params), loss(adam_params)": _custom_constraint,
  "chain = cola.sampling.sample_chain(step, init(params)": _sampling,
  "more = cola.sampling.sample_chain(step, chain.state": _sampling_resumed,
  "observed = run(init(params), jax.random.key(4))": _sampling_observed,
  "free_log_probs = cola.sampling.posterior_predictive(": _blackjax_sgld,
  "simplex_fits = [fit(tx, simplex_loss, one_hot_start)": _simplex,
  "ball_fits = [": _ball,
}
WITH_CODE = [p for p in PAGES if _blocks(p)]


def test_every_claim_names_a_block():
  blocks = [block for page in WITH_CODE for block in _blocks(page)]
  for line, check in CLAIMS.items():
    assert any(line in block for block in blocks), (line, check.__name__)


@pytest.mark.parametrize("page", WITH_CODE, ids=[str(p.relative_to(ROOT)) for p in WITH_CODE])
def test_page_runs_top_to_bottom(page):
  blocks = _blocks(page)
  for module in ("flax", "orbax.checkpoint", "equinox", "blackjax"):
    imported = rf"^\s*(from {re.escape(module)}\b|import ([\w.]+( as \w+)?, )*{re.escape(module)}\b)"
    if any(re.search(imported, b, flags=re.MULTILINE) for b in blocks):
      pytest.importorskip(module)
  namespace = {}
  config = jax.config.values
  try:
    for block in blocks:
      with cola_warnings() as said:
        exec(compile(block, str(page), "exec"), namespace)
      assert not said, f"a block of {page.name} warns, as it would when copied: {said[0].message}"
      for line, check in CLAIMS.items():
        if line in block:
          check(namespace)
  finally:  # a page may set JAX's flags, as its reader would; the tests after it in this process must not see them
    for name, value in config.items():
      if jax.config.values[name] != value:
        jax.config.update(name, value)


def test_every_page_has_a_title():
  for page in PAGES:
    assert page.read_text().startswith("# "), page


def test_readme_is_a_landing_page_whose_links_work_from_the_wheel():
  """The README is the package's long description: at most 200 lines, every link and image absolute."""
  text = README.read_text()
  assert len(text.splitlines()) <= 200
  targets = re.findall(r"\]\(([^)\s]+)\)", text)
  assert targets
  assert [t for t in targets if not t.startswith(REPOSITORY)] == []


def test_demo_numbers_are_those_of_the_committed_run():
  """docs/reproductions.md quotes results/paper/demo.json, and names the versions that made it."""
  run = json.loads((ROOT / "results" / "paper" / "demo.json").read_text())
  page = (DOCS / "reproductions.md").read_text()
  for name, label in run["methods"].items():
    row = re.search(rf"^\| {re.escape(label)} \| (.*) \|$", page, flags=re.MULTILINE)
    assert row, label
    summary = run["summary"][name]
    expected = [
      f"{summary['train_loss_mean']:.3f} +- {summary['train_loss_std']:.3f}",
      f"{summary['test_loss_mean']:.3f} +- {summary['test_loss_std']:.3f}",
      f"{100 * summary['test_accuracy_mean']:.1f} +- {100 * summary['test_accuracy_std']:.1f} %",
    ]
    assert row.group(1).split(" | ") == expected
  for package in ("jax", "optax", "flax", "numpy"):
    assert f"{package} {run['versions'][package]}" in page


def test_landing_pages_show_the_committed_spiral_run():
  """The README and the site's index show results/paper/spiral.png and quote results/paper/spiral.json at its
  deepest net, with the versions that made it."""
  run = json.loads((ROOT / "results" / "paper" / "spiral.json").read_text())
  depth = str(max(run["depths"]))
  for page in (README, DOCS / "index.md"):
    text = " ".join(page.read_text().split())
    assert "results/paper/spiral.png)" in text, page
    assert f"{run['config']['epochs']} epochs" in text and f"{run['config']['seeds']} seeds" in text, page
    assert f"with {depth} hidden layers" in text, page
    for method in ("ocola_od_tau", "sgd"):
      summary = run["summary"][method][depth]
      quoted = f"{100 * summary['test_accuracy_mean']:.1f} +- {100 * summary['test_accuracy_std']:.1f} %"
      assert quoted in text, (page, method, quoted)
    for package in ("jax", "optax", "flax", "numpy"):
      assert f"{package} {run['versions'][package]}" in text, (page, package)


def test_errata_cite_tests_that_exist():
  """docs/errata.md names the tests that show each item (`tests/file.py::test`, `::test` for the same file)."""
  errata = (DOCS / "errata.md").read_text()
  cited, current = [], None
  for path, name in re.findall(r"`(tests/[\w/]+\.py)?(?:::(\w+))?`", errata):
    current = path or current
    if path or name:
      cited.append((current, name))
  assert len(cited) >= 10
  for path, name in cited:
    source = (ROOT / path).read_text()
    assert not name or f"def {name}(" in source, (path, name)


@pytest.fixture(scope="module")
def ext():
  sys.path.insert(0, str(DOCS / "ext"))
  yield __import__("api_reference")
  sys.path.remove(str(DOCS / "ext"))


def test_api_reference_has_an_entry_for_every_public_name(ext):
  text = ext.reference()
  entries = re.findall(r"^\.\. auto(?:function|class|module):: cola_jax\.(\w+)$", text, flags=re.MULTILINE)
  assert sorted(entries) == sorted(cola_jax.__all__)
  # A subpackage's names, each its own entry (cola_jax.sampling.sample_chain), its module without :members:
  entries = re.findall(r"^\.\. auto(?:function|class):: cola_jax\.sampling\.(\w+)$", text, flags=re.MULTILINE)
  assert sorted(entries) == sorted(cola_jax.sampling.__all__)
  assert ".. automodule:: cola_jax.sampling\n\n.. " in text


def test_a_name_from_a_new_module_goes_under_more(ext, monkeypatch):
  module = type(sys)("cola_jax.somewhere_new")
  new = lambda: None
  new.__module__ = module.__name__
  monkeypatch.setattr(cola_jax, "new_public_name", new, raising=False)
  monkeypatch.setattr(cola_jax, "__all__", [*cola_jax.__all__, "new_public_name"])
  assert ext.grouped(cola_jax)[ext.MORE] == ["new_public_name"]
  assert ".. autofunction:: cola_jax.new_public_name" in ext.reference()


def test_coverage_check_names_the_missing_entries():
  pytest.importorskip("sphinx")
  sys.path.insert(0, str(DOCS / "ext"))
  try:
    coverage_check = __import__("coverage_check")
  finally:
    sys.path.remove(str(DOCS / "ext"))
  documented = {f"cola_jax.{name}" for name in cola_jax.__all__}
  documented |= {f"cola_jax.sampling.{name}" for name in cola_jax.sampling.__all__}
  assert coverage_check.missing_entries(cola_jax, documented) == []
  assert coverage_check.missing_entries(cola_jax, documented - {"cola_jax.Orthogonal"}) == ["Orthogonal"]
  missing = documented - {"cola_jax.sampling.sample_chain"}
  assert coverage_check.missing_entries(cola_jax, missing) == ["sampling.sample_chain"]


def test_the_site_serves_its_own_mathjax(monkeypatch):
  """The maths render with the site opened from disk and no network: MathJax is loaded from the site's _static/
  (copied there by sphinx-mathjax-offline, the docs extra), never from an address."""
  monkeypatch.setattr(sys, "path", list(sys.path))  # conf.py puts the clone and docs/ext on it
  conf = runpy.run_path(str(DOCS / "conf.py"))
  assert "sphinx.ext.mathjax" in conf["extensions"] and "sphinx-mathjax-offline" in conf["extensions"]
  path = conf.get("mathjax_path", "")
  assert path.endswith(".js") and not re.match(r"^([a-z]+:)?//", path), path
  package = importlib.util.find_spec("sphinx-mathjax-offline")
  if package is None:
    pytest.skip("the docs extra is not installed")
  # The package copies its static/mathjax/ to the site's _static/mathjax/.
  assert (pathlib.Path(package.origin).parent / "static" / path).is_file(), path


def test_the_development_page_lists_every_module():
  """Its layout table names each module of the package: a new module without a line fails."""
  layout = (DOCS / "development.md").read_text().split("## Layout", 1)[1].split("```")[1]
  package = ROOT / "cola_jax"
  for path in sorted(package.rglob("*.py")):
    if path.parent == package:
      assert f"cola_jax/{path.name}" in layout, path
    elif path.stem != "__init__":
      assert path.stem.lstrip("_") in layout, path  # the constraints' modules, by name
