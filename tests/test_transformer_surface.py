"""What the two transformer clients of issue 59 meet: one warning per misuse, said once at init from their own line
and a few lines long whatever the depth; no warning for a correct setup; errors in their words.

The clients (tests/_clients.py) are the JAX AI Stack's miniGPT in Flax NNX and an Equinox character GPT. Each case
builds a small model, inits through ``optax.chain`` (a combinator between the user and the transform), traces one
jitted update and runs one eager update; the 24-block models are only initialised (their shapes traced).
"""

import re
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from _cases import quick_or_extended
from _clients import equinox_gpt, nnx_gpt

import cola_jax as cola

nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")


def _nnx_params(depth=1):
  return nnx.as_pure(nnx.state(nnx_gpt(depth), nnx.Param))


def _equinox_params(depth=1):
  return eqx.filter(equinox_gpt(depth), eqx.is_array)


CLIENTS = {"nnx": _nnx_params, "equinox": _equinox_params}
KERNELS = {"nnx": r"kernel$", "equinox": r"(proj|up|down|head)/weight$"}  # the matrices, by the clients' names

DEFAULT = "not told which leaves to constrain"
QKV = "constraint with its default axes on 3 Flax attention kernels (features, heads, head_dim)"
ENTRIES = {  # each entry as a user sets it up, and its misuses on a client: the beginnings of its warnings
  "c_cola_od": (lambda client: cola.c_cola_od(0.1, radius=0.1), {"nnx": [DEFAULT], "equinox": [DEFAULT]}),
  "c_cola_ud": (lambda client: cola.c_cola_ud(0.1, friction=1.0, radius=0.1), {"nnx": [DEFAULT], "equinox": [DEFAULT]}),
  "o_cola_od": (lambda client: cola.o_cola_od(0.1), {"nnx": [DEFAULT, f"Orthogonal {QKV}"], "equinox": [DEFAULT]}),
  "o_cola_ud": (
    lambda client: cola.o_cola_ud(0.1, friction=1.0),
    {"nnx": [DEFAULT, f"Orthogonal {QKV}"], "equinox": [DEFAULT]},
  ),
  "hyperspherical_descent": (lambda client: cola.hyperspherical_descent(0.1), {"nnx": [DEFAULT], "equinox": [DEFAULT]}),
  "manifold_muon": (
    lambda client: cola.manifold_muon(0.1),
    {"nnx": [DEFAULT, f"Orthogonal {QKV}"], "equinox": [DEFAULT]},
  ),
  "cola_od": (
    lambda client: cola.cola_od(0.1, constraints=cola.path_constraints([(KERNELS[client], cola.Orthogonal())])),
    {"nnx": [f"Orthogonal {QKV}"], "equinox": []},
  ),
  "cola_ud": (
    lambda client: cola.cola_ud(
      0.1, friction=1.0, constraints=cola.path_constraints([(KERNELS[client], cola.UnitNorm(axis=None))])
    ),
    {"nnx": [f"UnitNorm {QKV}"], "equinox": []},
  ),
  "constrained": (
    lambda client: cola.constrained(
      optax.adam(1e-3), constraints=cola.path_constraints([(KERNELS[client], cola.MaxNorm(1.0))])
    ),
    {"nnx": [f"MaxNorm {QKV}"], "equinox": []},
  ),
}
# A default and a 3-D kernel; an Equinox model: traced, not updated eagerly (the first quick, the second extended).
QUICK = {("nnx", "o_cola_od"), ("equinox", "c_cola_od")}


def _said(run) -> list:
  """The warnings ``run()`` says, each as often as it says it."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    run()
  return caught


@pytest.mark.parametrize(
  ("client", "entry"),
  quick_or_extended(
    [(c, e) for e in ENTRIES for c in CLIENTS], {("nnx", "o_cola_od")}, ids=lambda c, e: f"{c}-{e}", extended=QUICK
  ),
)
def test_each_misuse_warns_once_over_init_a_jit_trace_and_an_eager_update_from_the_callers_line(client, entry):
  """The quick cases leave out the eager update, whose first call compiles every operation of the step (10 s and
  more on two shared cores): test_validation's quick suite updates eagerly, on a small transformer."""
  make, misuses = ENTRIES[entry][0], ENTRIES[entry][1][client]
  params = CLIENTS[client]()
  grads = jax.tree.map(jnp.zeros_like, params)
  eager = (client, entry) not in QUICK

  def run():
    tx = optax.chain(optax.clip_by_global_norm(1.0), make(client))
    state = tx.init(params)
    jax.jit(tx.update).trace(grads, state, params)
    if eager:
      tx.update(grads, state, params)

  caught = _said(run)
  messages = [str(w.message) for w in caught]
  assert len(messages) == len(misuses), messages
  for misuse in misuses:
    assert len([m for m in messages if misuse in m.split(". ")[0]]) == 1, (misuse, messages)
  assert {w.filename for w in caught} <= {__file__}


def test_a_default_under_inject_hyperparams_warns_once():
  """optax.inject_hyperparams rebuilds the transform at every update: init said it, the update does not."""
  params = _nnx_params()
  grads = jax.tree.map(jnp.zeros_like, params)

  def run():
    tx = optax.inject_hyperparams(cola.c_cola_ud)(learning_rate=0.1, friction=1.0, radius=0.1)
    jax.jit(tx.update).trace(grads, tx.init(params), params)

  caught = _said(run)
  assert [DEFAULT in str(w.message) for w in caught] == [True] and caught[0].filename == __file__
  assert "cola.Circle(0.1)" in str(caught[0].message)  # the radius as written, not the array optax made of it


@pytest.mark.parametrize("client", ["nnx", pytest.param("equinox", marks=pytest.mark.extended)])  # quick: nnx
def test_on_24_blocks_each_warning_names_a_few_leaves_counts_the_rest_and_stays_short(client):
  params = CLIENTS[client](24)
  caught = _said(lambda: jax.eval_shape(cola.o_cola_od(0.1).init, params))
  messages = [str(w.message) for w in caught]
  assert len(messages) == (2 if client == "nnx" else 1), messages
  (default,) = [m for m in messages if DEFAULT in m]
  taken, shown, more = re.search(r"constrains these (\d+): (.*?) and (\d+) more\.", default).groups()
  assert len(shown.split(", ")) == 3 and int(more) == int(taken) - 3 and int(taken) > 100
  if client == "nnx":
    (qkv,) = [m for m in messages if DEFAULT not in m]
    assert qkv.startswith(f"Orthogonal constraint with its default axes on {3 * 24} Flax attention kernels")
    assert f"and {3 * 24 - 3} more. It views" in qkv
  assert max(len(m) for m in messages) < 600, [len(m) for m in messages]
  assert {w.filename for w in caught} == {__file__}


def _spellings(message: str) -> tuple[str, str]:
  per_head = re.search(r"Per head: (.+?)(?:; per layer|, each head's)", message).group(1)
  per_layer = re.search(r"per layer: (.+?)(?:\.$|, each column)", message).group(1)
  return per_head, per_layer


@pytest.mark.parametrize(
  ("constraint", "per_head_holds", "per_layer_holds"),
  [
    pytest.param(  # each head's (features, head_dim) matrix orthonormal; the layer's (features, heads * head_dim)
      cola.Orthogonal(),
      lambda q: jnp.einsum("fhd,fhe->hde", q, q) - jnp.eye(q.shape[2]),
      lambda q: (m := q.reshape(q.shape[0], -1)).T @ m - jnp.eye(m.shape[1]),
      id="Orthogonal",
    ),
    pytest.param(  # each head's matrix of Frobenius norm 1; each column of the layer's matrix of norm 1
      cola.UnitNorm(),
      lambda q: jnp.sqrt(jnp.sum(q**2, axis=(0, 2))) - 1,
      lambda q: jnp.linalg.norm(q, axis=0) - 1,
      id="UnitNorm",
      marks=pytest.mark.slow,
    ),
  ],
)
def test_the_out_kernel_passes_quietly_and_a_query_kernel_warns_with_a_per_head_and_a_per_layer_spelling(
  constraint, per_head_holds, per_layer_holds
):
  """The NNX output kernel (heads, head_dim, features) is viewed as the layer's (heads * head_dim, features) matrix,
  a correct setup; the query kernel (features, heads, head_dim) as neither per head nor per layer. Each spelling the
  warning gives, applied, keeps what it says and silences the warning."""
  params = _nnx_params()
  on = lambda layer, c: cola.path_constraints([(rf"attention/{layer}/kernel$", c)])
  assert _said(lambda: cola.cola_od(0.1, constraints=on("out", constraint)).init(params)) == []
  caught = _said(lambda: cola.cola_od(0.1, constraints=on("query", constraint)).init(params))
  (message,) = [str(w.message) for w in caught]
  assert caught[0].filename == __file__
  per_head, per_layer = _spellings(message)
  assert per_head != per_layer
  for spelled, holds in ((per_head, per_head_holds), (per_layer, per_layer_holds)):
    spelled_constraint = eval(spelled, {"Orthogonal": cola.Orthogonal, "UnitNorm": cola.UnitNorm})
    assert _said(lambda: cola.cola_od(0.1, constraints=on("query", spelled_constraint)).init(params)) == []
    query = cola.project_params(params, on("query", spelled_constraint))["blocks"][0]["attention"]["query"]["kernel"]
    assert float(jnp.max(jnp.abs(holds(query)))) < 1e-5, spelled
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    default = cola.project_params(params, on("query", constraint))["blocks"][0]["attention"]["query"]["kernel"]
  assert float(jnp.max(jnp.abs(per_head_holds(default)))) > 0.1  # what the warning is about


def test_an_unfiltered_equinox_model_is_an_error_showing_the_filter():
  model = equinox_gpt(1)
  with pytest.raises(TypeError) as error:
    cola.o_cola_od(0.1).init(model)
  message = str(error.value)
  assert message.startswith("o_cola_od: the leaf at .blocks[0].attention.dropout.inference has dtype bool")
  assert "eqx.filter(model, eqx.is_array)" in message and "eqx.partition(model, eqx.is_array)" in message
  with pytest.raises(TypeError) as error:  # no Equinox model, no word of Equinox
    cola.cola_od(0.1).init({"flag": jnp.array(True)})
  assert "eqx" not in str(error.value)


def test_a_tree_that_is_not_a_prefix_of_the_parameters_names_the_first_path_that_differs():
  params = _nnx_params()
  kinds = ", ".join(f"['{k}']" for k in sorted(params))  # a State flattens by sorted keys
  with pytest.raises(ValueError) as error:
    cola.cola_od(0.1, constraints={"output_layer": {"kernel": cola.Orthogonal()}}).init(params)
  assert str(error.value).startswith(
    "cola_od: constraints must be a pytree prefix of the parameters (their tree, cut anywhere), but constraints is "
    f"a dict where params is a State of {kinds}. "
  )
  assert "cola.path_constraints" in str(error.value)
  partial = nnx.State({"output_layer": {"kernel": cola.Orthogonal()}})
  with pytest.raises(ValueError, match=re.escape(f"but constraints has no ['blocks']: params is a State of {kinds}.")):
    cola.cola_od(0.1, constraints=partial).init(params)

  params = _equinox_params()
  radius = jax.tree.map(lambda p: 0.1 if p.ndim == 2 else None, params)
  radius = eqx.tree_at(lambda m: m.lm_head, radius, {"weight": 0.1, "bias": None}, is_leaf=lambda x: x is None)
  with pytest.raises(ValueError) as error:
    cola.c_cola_od(0.1, radius=radius).init(params)
  assert str(error.value).startswith(
    "c_cola_od: radius must be a pytree prefix of the parameters (their tree, cut anywhere), but radius.lm_head is "
    "a dict where params.lm_head is a Linear of .weight, .bias. "
  )
  assert "a callable params -> radii" in str(error.value)
  cola.c_cola_od(0.1, radius=jax.tree.map(lambda p: 0.1 if p.ndim == 2 else None, params)).init(params)  # a prefix
