r"""The constrained Langevin maps, generic over the constraint manifold.

Each function advances one parameter leaf on its manifold ``M = {g(q) = 0}``;
``constraint`` supplies the geometry (:class:`cola_jax.constraints.Constraint`).
Positions ``q`` include slack variables, ``V(q)`` is the loss (its gradient on
the slacks is zero), ``Pi(q)`` is the orthogonal projection onto the cotangent
space ``T*_q M``, ``h`` the step size, ``gamma`` the friction and ``tau`` the
temperature.

Overdamped (Euler-Maruyama, then projection onto ``M``):

.. math::
  q_{n+1} = \mathrm{proj}_{M}\big(q_n - h \nabla V(q_n) + \sqrt{2 \tau h}\, R_n\big).

Underdamped, split into

.. math::
  O:\ p \leftarrow \Pi(q)\big(e^{-\gamma h} p + \sqrt{\tau (1 - e^{-2\gamma h})}\, R\big),
  \quad B:\ p \leftarrow p - h\, \Pi(q) \nabla V(q),
  \quad A:\ \text{free flight on } M \text{ for time } h,

composed in the order O, B, A (the paper's OBA), as BAOAB, or in any order a
:class:`Splitting` gives (a sequence of A, B and O steps, each for a fraction
of ``h``, every O step with its own draw). The invariant measure of both dynamics has
density proportional to ``exp(-V / tau)`` with respect to the surface measure
of ``M`` (times the Gaussian in ``p`` for the underdamped one).

A point, a momentum and the noise may be any pytree of arrays (a slack
constraint's ``(x, s)``): the maps scale and add them leaf by leaf.

Randomness is explicit: a map reads its step's standard normal numbers
``noise`` as an argument (None: no noise), drawn from a PRNG key by
:func:`draw_noise`, which reads only the point's shapes, dtypes and shardings.
A transform can thus draw the noise of many leaves in one program and hand
each map its own.

With ``tau = 0`` and no constraint, :func:`overdamped_step` is gradient descent
with learning rate ``h`` and :func:`oba_step` is SGD with momentum
``exp(-gamma h)`` and learning rate ``h**2``, the momentum ``p`` being
``-h`` times SGD's.

References:
  Leimkuhler, Pouchon, Vlaar, Storkey, *Constraint-Based Regularization of
  Neural Networks*, OPT2020, Sec. 3 and Appendix B.
  Leimkuhler and Matthews, *Efficient molecular dynamics using geodesic
  integration and solvent-solute splitting*, Proc. R. Soc. A, 2016.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from cola_jax.constraints.base import Constraint, Momentum, Point


def draw_noise(constraint: Constraint, key: jax.Array, point: Point, dynamics: str) -> Any:
  """The standard normal numbers one step of ``dynamics`` reads, drawn from ``key``.

  ``dynamics`` is ``"overdamped"`` (:func:`overdamped_step`: an ambient
  vector), ``"OBA"`` (:func:`oba_step`) or ``"BAOAB"`` (:func:`baoab_step`
  and :func:`o_step`: the numbers of a cotangent vector), the ready-made
  splittings of one O step (:meth:`Splitting.draw` gives those of any
  splitting). Only the shapes, dtypes and shardings of ``point`` are read:
  the draw of a leaf does not wait for its values.

  Example:
    >>> import jax, jax.numpy as jnp, cola_jax as cola
    >>> from cola_jax import langevin
    >>> circle, w = cola.Circle(1.0), jnp.array([0.6, -0.6])
    >>> point = circle.point(w, circle.init(w))
    >>> noise = langevin.draw_noise(circle, jax.random.key(0), point, "overdamped")  # (theta, xi) entries
    >>> [r.shape for r in noise]
    [(2,), (2,)]
  """
  if dynamics == "overdamped":
    return constraint.ambient_normal(key, point)
  if dynamics not in SPLITTINGS:
    raise ValueError(f"draw_noise: dynamics must be one of {('overdamped', *SPLITTINGS)}, got {dynamics!r}.")
  (noise,) = SPLITTINGS[dynamics].draw(constraint, key, point)
  return noise


def overdamped_step(
  constraint: Constraint,
  point: Point,
  grad: jax.Array,
  h,
  noise_scale=None,
  noise: Any = None,
) -> Point:
  """One Euler-Maruyama step of size ``h``, projected back onto the manifold.

  ``noise_scale`` is ``sqrt(2 tau h)`` and ``noise`` the step's numbers
  (:func:`draw_noise` with ``"overdamped"``); without ``noise``, no noise.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> from cola_jax import langevin
    >>> circle, w = cola.Circle(1.0), jnp.array([0.6, -0.6])
    >>> point = circle.point(w, circle.init(w))  # (theta, xi) = (w, sqrt(1 - w**2))
    >>> theta, xi = langevin.overdamped_step(circle, point, jnp.array([-4.0, 0.0]), h=0.1)
    >>> [round(float(t), 3) for t in theta], bool(jnp.allclose(theta**2 + xi**2, 1.0))  # (1.0, 0.8) projected
    ([0.781, -0.6], True)
  """
  step = jax.tree.map(lambda force: -h * force, constraint.ambient_gradient(point, grad))
  if noise is not None:
    step = jax.tree.map(lambda s, r: s + noise_scale * r, step, noise)
  return constraint.project(point, step)


def o_step(
  constraint: Constraint,
  point: Point,
  momentum: Momentum,
  decay,
  noise_scale=None,
  noise: Any = None,
) -> Momentum:
  """Friction and fluctuation: the exact Ornstein-Uhlenbeck flow on ``T*_q M``.

  ``decay`` is ``exp(-gamma h)``, ``noise_scale`` is
  ``sqrt(tau (1 - exp(-2 gamma h)))`` and ``noise`` the step's numbers
  (:func:`draw_noise` with ``"BAOAB"``); without ``noise``, friction only.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> from cola_jax import langevin
    >>> circle, w = cola.Circle(1.0), jnp.array([0.6, -0.6])
    >>> point = circle.point(w, circle.init(w))  # (theta, xi) = (w, sqrt(1 - w**2))
    >>> langevin.o_step(circle, point, jnp.array([1.0, -1.0]), decay=0.5)  # no noise: friction only
    Array([ 0.5, -0.5], dtype=float32)
  """
  momentum = jax.tree.map(lambda p: decay * p, momentum)
  if noise is not None:
    kick = constraint.cotangent_normal(point, noise)
    momentum = jax.tree.map(lambda p, r: p + noise_scale * r, momentum, kick)
  return momentum


def b_step(constraint: Constraint, point: Point, momentum: Momentum, grad: jax.Array, h) -> Momentum:
  """The kick by the projected force: ``p - h Pi(q) grad V(q)``.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> from cola_jax import langevin
    >>> circle, w = cola.Circle(1.0), jnp.array([0.6, -0.6])
    >>> point = circle.point(w, circle.init(w))  # (theta, xi) = (w, sqrt(1 - w**2))
    >>> momentum = langevin.b_step(circle, point, jnp.zeros(2), jnp.array([1.0, 1.0]), h=0.1)
    >>> [round(float(p), 3) for p in momentum]  # -h grad xi / r
    [-0.08, -0.08]
  """
  return jax.tree.map(lambda p, f: p - h * f, momentum, constraint.projected_gradient(point, grad))


def a_step(constraint: Constraint, point: Point, momentum: Momentum, h) -> tuple[Point, Momentum]:
  """Free flight on the manifold for time ``h`` (exact or RATTLE, per geometry).

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> from cola_jax import langevin
    >>> circle, w = cola.Circle(1.0), jnp.array([0.6, -0.6])
    >>> point = circle.point(w, circle.init(w))  # (theta, xi) = (w, sqrt(1 - w**2))
    >>> (theta, xi), momentum = langevin.a_step(circle, point, jnp.array([1.0, -1.0]), h=0.1)
    >>> [round(float(t), 3) for t in theta], bool(jnp.allclose(theta**2 + xi**2, 1.0)), momentum
    ([0.677, -0.677], True, Array([ 1., -1.], dtype=float32))
  """
  return constraint.a_step(point, momentum, h)


def oba_step(
  constraint: Constraint,
  point: Point,
  momentum: Momentum,
  grad: jax.Array,
  h,
  decay,
  noise_scale=None,
  noise: Any = None,
) -> tuple[Point, Momentum]:
  """One underdamped step in the paper's order: O, then B, then A.

  ``noise``: the step's numbers (:func:`draw_noise` with ``"OBA"``), or None.

  Where the geometry says so (``constraint.project_noise_with_force``), O's
  noise and B's force are projected onto the cotangent space in one go,
  ``e^{-gamma h} p + Pi(q)(noise_scale R - h grad V(q))``: the same momentum
  up to rounding (``p`` is cotangent and ``Pi(q)`` linear), one projection
  instead of two.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> from cola_jax import langevin
    >>> circle, w = cola.Circle(1.0), jnp.array([0.6, -0.6])
    >>> point = circle.point(w, circle.init(w))  # (theta, xi) = (w, sqrt(1 - w**2))
    >>> grad = jnp.array([1.0, 1.0])
    >>> (theta, xi), momentum = langevin.oba_step(circle, point, jnp.zeros(2), grad, h=0.1, decay=0.9)
    >>> [round(float(p), 3) for p in momentum], bool(jnp.allclose(theta**2 + xi**2, 1.0))  # p = -h grad xi / r
    ([-0.08, -0.08], True)
  """
  if noise is not None and constraint.project_noise_with_force:
    force = jax.tree.map(lambda r, g: noise_scale * r - h * g, noise, constraint.ambient_gradient(point, grad))
    momentum = jax.tree.map(lambda p, f: decay * p + f, momentum, constraint.cotangent(point, force))
  else:
    momentum = b_step(constraint, point, o_step(constraint, point, momentum, decay, noise_scale, noise), grad, h)
  return a_step(constraint, point, momentum, h)


def baoab_step(
  constraint: Constraint,
  point: Point,
  momentum: Momentum,
  grad: jax.Array,
  h,
  kick,
  decay,
  noise_scale=None,
  noise: Any = None,
) -> tuple[Point, Momentum]:
  """One BAOAB step, written as B A O A with the kick ``kick``.

  ``noise``: the step's numbers (:func:`draw_noise` with ``"BAOAB"``), or None.

  BAOAB's closing half kick ``B(h/2)`` needs the gradient at the new point,
  which an optimizer only receives at its next call. Merging it with the next
  step's opening half kick gives ``B(h) A(h/2) O A(h/2)`` per call, with
  ``kick = h/2`` on the first call and ``h`` afterwards: the positions are
  BAOAB's exactly, and the stored momentum is the one before the closing half
  kick.

  References:
    Leimkuhler and Matthews, *Rational construction of stochastic numerical
    methods for molecular sampling*, AMRX 2013 (BAOAB's configurational
    accuracy).

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> from cola_jax import langevin
    >>> circle, w = cola.Circle(1.0), jnp.array([0.6, -0.6])
    >>> point = circle.point(w, circle.init(w))  # (theta, xi) = (w, sqrt(1 - w**2))
    >>> grad = jnp.array([1.0, 1.0])
    >>> (theta, xi), momentum = langevin.baoab_step(
    ...     circle, point, jnp.zeros(2), grad, h=0.1, kick=0.05, decay=0.9)  # the first call: kick h / 2
    >>> [round(float(p), 3) for p in momentum], bool(jnp.allclose(theta**2 + xi**2, 1.0))
    ([-0.036, -0.036], True)
  """
  momentum = b_step(constraint, point, momentum, grad, kick)
  point, momentum = a_step(constraint, point, momentum, h / 2)
  momentum = o_step(constraint, point, momentum, decay, noise_scale, noise)
  return a_step(constraint, point, momentum, h / 2)


_KINDS = ("A", "B", "O")


@dataclasses.dataclass(frozen=True)
class Splitting:
  r"""An underdamped integrator: a sequence of A, B and O steps, each taking a fraction of the step ``h``.

  One step of the splitting composes the flows, in order,

  .. math::
    A_f:\ (q, p) \leftarrow \text{free flight on } M \text{ for time } f h, \qquad
    B_f:\ p \leftarrow p - f h\, \Pi(q) \nabla V(q), \qquad
    O_f:\ p \leftarrow \Pi(q)\big(e^{-\gamma f h} p + \sqrt{\tau (1 - e^{-2 \gamma f h})}\, R\big),

  where the fractions ``f`` of each kind sum to 1 (a consistent step of size
  ``h``) and every ``O`` step draws its own standard normal numbers ``R``
  (several ``O`` steps: several draws per step). Each of the three flows
  preserves the invariant measure of its part of the dynamics, so any such
  composition samples ``exp(-V / tau)`` on ``M`` up to its discretisation
  error; symmetric ones (``BAOAB``, ``OBABO``) have second-order weak error.

  An optimizer receives one gradient per call, at the current position, so
  the B steps must all be taken where the step starts: they lie before the
  first A step or after the last one (a wrapped run, as BAOAB's closing
  ``B_{1/2}`` and the next step's opening ``B_{1/2}``). A call then runs the
  steps after the last A step (those of the previous step, merged with the
  current one: consecutive B steps as one kick) and then the steps up to the
  last A step; the first call, having no previous step, skips the former.
  The positions after each call are exactly the splitting's; the stored
  momentum is the one before the steps after the last A.

  Where an O step is directly followed by a B step and the geometry says so
  (``Constraint.project_noise_with_force``), both are projected onto the
  cotangent space in one go (the same momentum up to rounding, as in
  :func:`oba_step`).

  Keys: a splitting with one O step draws its numbers from the leaf's key
  itself; with ``n`` O steps, the ``j``-th O step of a call draws from
  ``jax.random.split(key, n)[j]``.

  Args:
    steps: the letters ``"A"``, ``"B"``, ``"O"`` as a string (each kind's
      fraction divided equally among its steps: ``"BAOAB"`` is ``B_{1/2}
      A_{1/2} O_1 A_{1/2} B_{1/2}``), or a sequence of ``(letter, fraction)``
      pairs.

  Raises:
    ValueError: naming ``splitting``, for another letter, a fraction not
      positive, a kind missing or whose fractions do not sum to 1, or a B step
      between two A steps.

  Example:
    >>> import jax, jax.numpy as jnp, optax, cola_jax as cola
    >>> obabo = cola.Splitting("OBABO")  # O_{1/2} B_{1/2} A_1 B_{1/2} O_{1/2}: two draws per step
    >>> obabo.steps
    (('O', 0.5), ('B', 0.5), ('A', 1.0), ('B', 0.5), ('O', 0.5))
    >>> tx = cola.cola_ud(0.1, friction=1.0, constraints=cola.Circle(1.0), temperature=1e-3,
    ...                   key=jax.random.key(0), splitting=obabo)
    >>> w = jnp.array([0.6, -0.6])
    >>> updates, state = tx.update(jnp.ones(2), tx.init(w), w)
    >>> bool(jnp.all(jnp.abs(optax.apply_updates(w, updates)) <= 1.0))
    True

  References:
    Leimkuhler and Matthews, *Rational construction of stochastic numerical
    methods for molecular sampling*, AMRX 2013 (splittings of Langevin
    dynamics and their accuracy).
  """

  steps: tuple[tuple[str, float], ...]

  def __init__(self, steps: "str | Sequence[tuple[str, float]]"):
    if isinstance(steps, str):
      pairs = tuple((letter, 1.0 / steps.count(letter)) for letter in steps)
    else:
      try:
        pairs = tuple((letter, float(fraction)) for letter, fraction in steps)
      except (TypeError, ValueError):
        raise ValueError(
          f"splitting: the steps must be a string of A, B, O or (letter, fraction) pairs, got {steps!r}."
        ) from None
    object.__setattr__(self, "steps", pairs)
    self._check()

  def _check(self) -> None:
    for letter, fraction in self.steps:
      if letter not in _KINDS:
        raise ValueError(f"splitting: steps are A, B or O, got {letter!r} in {self.steps!r}.")
      if not fraction > 0:
        raise ValueError(f"splitting: the fraction of every step must be positive, got {self.steps!r}.")
    for kind in _KINDS:
      total = sum(f for letter, f in self.steps if letter == kind)
      if abs(total - 1) > 1e-9:
        raise ValueError(
          f"splitting: the fractions of the {kind} steps must sum to 1 (a step of size h), got {total} in "
          f"{self.steps!r}."
        )
    letters = [letter for letter, _ in self.steps]
    first_a, last_a = letters.index("A"), len(letters) - 1 - letters[::-1].index("A")
    if "B" in letters[first_a:last_a]:
      raise ValueError(
        f"splitting: every B step must come before the first A step or after the last one: an optimizer gets "
        f"one gradient per step, at the position where the step starts; got {self.steps!r}."
      )

  def _moves(self) -> tuple[tuple[str, float, float], ...]:
    """One call's ``(letter, fraction, fraction on the first call)``: the steps after the last A, then the rest.

    Consecutive B steps are one kick.
    """
    letters = [letter for letter, _ in self.steps]
    start = len(letters) - letters[::-1].index("A")  # after the last A step
    moves: list[tuple[str, float, float]] = [(k, f, 0.0) for k, f in self.steps[start:]]
    moves += [(k, f, f) for k, f in self.steps[:start]]
    merged: list[tuple[str, float, float]] = []
    for letter, fraction, first in moves:
      if merged and letter == "B" and merged[-1][0] == "B":
        _, f, f0 = merged.pop()
        fraction, first = f + fraction, f0 + first
      merged.append((letter, fraction, first))
    return tuple(merged)

  @property
  def draws(self) -> int:
    """How many draws a step takes: one per O step."""
    return sum(letter == "O" for letter, _ in self.steps)

  def _fused(self, constraint: Constraint) -> list[bool]:
    """Per move: whether it is an O step projected together with the B step after it."""
    moves = self._moves()
    return [
      constraint.project_noise_with_force
      and letter == "O"
      and first == fraction
      and i + 1 < len(moves)
      and moves[i + 1][0] == "B"
      and moves[i + 1][2] == moves[i + 1][1]
      for i, (letter, fraction, first) in enumerate(moves)
    ]

  def draw(self, constraint: Constraint, key: jax.Array, point: Point) -> tuple:
    """The standard normal numbers of a step's O steps, in order, drawn from ``key`` (see the keys above).

    Only the shapes, dtypes and shardings of ``point`` are read.
    """
    fused = [f for (letter, _, _), f in zip(self._moves(), self._fused(constraint)) if letter == "O"]
    keys = [key] if len(fused) == 1 else list(jax.random.split(key, len(fused)))
    return tuple((constraint.ambient_normal if f else constraint.cotangent_draw)(k, point) for f, k in zip(fused, keys))

  def step(
    self,
    constraint: Constraint,
    point: Point,
    momentum: Momentum,
    grad: jax.Array,
    h,
    decay,
    *,
    first=False,
    temperature=None,
    noises: Sequence | None = None,
  ) -> tuple[Point, Momentum]:
    """One call of the splitting: its moves (see above) from ``point`` with the gradient ``grad`` there.

    ``decay`` is ``exp(-gamma h)`` (an O step of fraction ``f`` decays by
    ``decay**f``), ``first`` whether this is the first call (a traced bool
    will do), ``temperature`` ``tau`` and ``noises`` the numbers of
    :meth:`draw` (None: no noise).
    """
    o_steps = iter(range(self.draws))
    moves, fused = self._moves(), self._fused(constraint)
    skip = None
    for i, (letter, fraction, on_first) in enumerate(moves):
      t = h if fraction == 1 else fraction * h
      if on_first != fraction:  # a move of the previous step: skipped on the first call
        t = jnp.where(first, on_first * h, t)
      if letter == "A":
        point, momentum = a_step(constraint, point, momentum, t)
      elif letter == "B":
        if i != skip:
          momentum = b_step(constraint, point, momentum, grad, t)
      else:
        noise = None if noises is None else noises[next(o_steps)]
        d = decay if fraction == 1 else decay**fraction
        scale = None if noise is None else jnp.sqrt(temperature * (1 - d * d))
        if on_first != fraction:
          d = jnp.where(first, jnp.ones_like(d), d)
          scale = None if scale is None else jnp.where(first, jnp.zeros_like(scale), scale)
        if fused[i] and noise is not None:
          kick = h if moves[i + 1][1] == 1 else moves[i + 1][1] * h
          force = jax.tree.map(lambda r, g: scale * r - kick * g, noise, constraint.ambient_gradient(point, grad))
          momentum = jax.tree.map(lambda p, f: d * p + f, momentum, constraint.cotangent(point, force))
          skip = i + 1
        else:
          momentum = o_step(constraint, point, momentum, d, scale, noise)
    return point, momentum


SPLITTINGS = {"OBA": Splitting("OBA"), "BAOAB": Splitting("BAOAB")}


def splitting_named(owner: str, splitting) -> Splitting:
  """The :class:`Splitting` that ``splitting`` names (a key of ``SPLITTINGS``) or is; ``owner`` names the caller.

  Example:
    >>> from cola_jax import langevin
    >>> langevin.splitting_named("cola_ud", "BAOAB") == langevin.SPLITTINGS["BAOAB"]
    True
    >>> langevin.splitting_named("cola_ud", "ABO")
    Traceback (most recent call last):
    ...
    ValueError: cola_ud: splitting must be one of ('OBA', 'BAOAB') or a cola.Splitting ..., got 'ABO'.
  """
  if isinstance(splitting, Splitting):
    return splitting
  if isinstance(splitting, str) and splitting in SPLITTINGS:
    return SPLITTINGS[splitting]
  raise ValueError(
    f"{owner}: splitting must be one of {tuple(SPLITTINGS)} or a cola.Splitting (such as "
    f"cola.Splitting('OBABO')), got {splitting!r}."
  )
