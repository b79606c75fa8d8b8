"""Every ```python block of the README runs, and says what it shows.

Each block runs on its own, in a fresh namespace after ``PREAMBLE``: the names
the README introduces once (``params`` and ``grads`` as its first example
defines them; images ``x`` and targets ``y`` for the Flax examples). A block
that needs anything else must define it. The claims a block's comments make are
checked on its namespace afterwards (``CLAIMS``).
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.DOTALL | re.MULTILINE)

PREAMBLE = """
import jax, jax.numpy as jnp, optax, cola_jax as cola

params = {"kernel": jax.random.normal(jax.random.key(0), (8, 4)), "bias": jnp.zeros(4)}
loss = lambda p, x: jnp.mean(jnp.tanh(x @ p["kernel"] + p["bias"]) ** 2)
grads = jax.grad(loss)(params, jnp.ones((2, 8)))
x = jax.random.normal(jax.random.key(1), (4, 8, 8, 1))
y = jax.random.normal(jax.random.key(2), (4, 3))
"""


def _orthonormal_kernel(ns):
  assert ns["residuals"]["bias"] is None
  assert ns["residuals"]["kernel"] < 1e-6


def _linen(ns):
  residuals = ns["residuals"]
  assert residuals["conv"]["kernel"] < 1e-5 and residuals["dense"]["kernel"] < 1e-5
  assert int(ns["state"].step) == 1


def _seeds(ns):
  kernels = ns["params"]["kernel"]
  assert kernels.shape == (10, 8, 4)
  assert float(jnp.max(jnp.abs(kernels))) <= 0.05 * (1 + 1e-6)
  assert len({bytes(k) for k in jax.device_get(kernels)}) == 10  # each seed its own run


def _sharded(ns):
  assert ns["opt_state"].constraint_states["kernel"].slack.sharding == ns["params"]["kernel"].sharding


def _implicit(ns):
  assert bool(ns["opt_state"].constraint_states["kernel"].converged)


def _from_sgd_momentum(ns):
  assert ns["h"] == pytest.approx(0.1**0.5) and ns["gamma"] == pytest.approx(-jnp.log(0.9) / 0.1**0.5)


CLAIMS = {  # a line of the block -> the check of what its comments say
  "residuals = cola.constraint_residuals(params, state)": _orthonormal_kernel,
  "residuals = cola.constraint_residuals(state.params, state.opt_state)": _linen,
  "params, states = train_seeds(": _seeds,
  "params = jax.device_put(params, shardings)": _sharded,
  "opt_state.constraint_states['kernel'].converged": _implicit,
  "h, gamma = cola.sgd_momentum_to_langevin(0.1, 0.9)": _from_sgd_momentum,
}


def test_every_claim_names_a_block():
  for line, check in CLAIMS.items():
    assert sum(line in block for block in BLOCKS) == 1, (line, check.__name__)


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block(block):
  if "from flax" in block:
    pytest.importorskip("flax")
  namespace = {}
  exec(compile(PREAMBLE, "<preamble>", "exec"), namespace)
  exec(compile(block, str(README), "exec"), namespace)
  for line, check in CLAIMS.items():
    if line in block:
      check(namespace)


def test_errata_cite_tests_that_exist():
  """docs/errata.md names the tests that show each item (`tests/file.py::test`, `::test` for the same file)."""
  errata = (README.parent / "docs" / "errata.md").read_text()
  cited, current = [], None
  for path, name in re.findall(r"`(tests/[\w/]+\.py)?(?:::(\w+))?`", errata):
    current = path or current
    if path or name:
      cited.append((current, name))
  assert len(cited) >= 10
  for path, name in cited:
    source = (README.parent / path).read_text()
    assert not name or f"def {name}(" in source, (path, name)
