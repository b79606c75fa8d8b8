"""Constraints chosen by regular expressions on the parameters' paths."""

import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from cola_jax.constraints.base import Constraint
from cola_jax.declared import is_box

_SHOWN_PATHS = 12  # how many of the parameters' paths an error lists


def _path_name(path) -> str:
  """A key path as ``'/'``-joined plain strings: ``Dense_0/kernel``, ``layers/3/kernel``."""
  return jax.tree_util.keystr(path, simple=True, separator="/")


class PathConstraints:
  """``params -> constraint pytree`` by the first rule whose regex finds the leaf's path.

  Made by :func:`path_constraints`; the rules were checked there.
  """

  def __init__(self, rules: list[tuple[re.Pattern, Constraint | None]], default: Constraint | None):
    self.rules = rules
    self.default = default

  def __repr__(self):
    rules = ", ".join(f"({pattern.pattern!r}, {constraint!r})" for pattern, constraint in self.rules)
    return f"path_constraints([{rules}], default={self.default!r})"

  def __call__(self, params: Any) -> Any:
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_box)
    paths = [_path_name(path) for path, _ in paths_and_leaves]
    matches = [[bool(pattern.search(name)) for pattern, _ in self.rules] for name in paths]
    choices = [row.index(True) if True in row else None for row in matches]
    for i in range(len(self.rules)):
      if paths and i not in choices:
        self._raise_unused(i, paths, [name for name, row in zip(paths, matches) if row[i]])
    return treedef.unflatten([self.default if choice is None else self.rules[choice][1] for choice in choices])

  def _raise_unused(self, i: int, paths: list[str], matched: list[str]):
    pattern, constraint = self.rules[i]
    rule = f"rule {i} ({pattern.pattern!r}, {constraint!r})"
    if matched:
      raise ValueError(
        f"path_constraints: {rule} selects no parameter: every path it matches "
        f"({', '.join(matched[:_SHOWN_PATHS])}) is taken by an earlier rule. Reorder "
        "the rules (the first match wins) or remove it."
      )
    shown = ", ".join(paths[:_SHOWN_PATHS]) + (", ..." if len(paths) > _SHOWN_PATHS else "")
    raise ValueError(
      f"path_constraints: {rule} matches no parameter path (re.search on "
      f"'/'-joined key paths). The {len(paths)} paths are: {shown}"
    )


def _check_constraint(value, where: str) -> Constraint | None:
  if value is not None and not isinstance(value, Constraint):
    raise TypeError(f"path_constraints: {where} must be a cola_jax Constraint or None, got {value!r}.")
  return value


def path_constraints(
  rules: Sequence[tuple[str | re.Pattern, Constraint | None]],
  default: Constraint | None = None,
) -> PathConstraints:
  """Constraints for the parameters whose key paths match regular expressions.

  Each leaf's key path is joined with ``'/'`` (dict keys, sequence indices and
  attribute names as plain strings: ``Dense_0/kernel``, ``layers/3/kernel``,
  ``params/encoder/attn/query/kernel``) and searched with :func:`re.search` by
  each rule's regex in turn; the first rule that matches gives the leaf's
  constraint, and leaves that no rule matches get ``default``. Linen metadata
  boxes and nnx Variables count as leaves, so boxed and plain parameters, and
  an nnx ``State``, have the same paths.

  A rule that selects no parameter (its regex matches no path, or every path
  it matches is taken by an earlier rule) is a ValueError naming the rule when
  the constraints are computed (at ``init``), so that a typo cannot leave a
  layer silently free.

  Args:
    rules: a sequence of ``(regex, constraint)`` pairs, ``regex`` a string or a
      compiled pattern, ``constraint`` a :class:`cola_jax.Constraint` or None
      (None keeps the matched leaves free, e.g. ``('bias', None)`` before a
      broader rule).
    default: the constraint of leaves that no rule matches (None: free).

  Returns:
    A callable ``params -> constraint pytree``, for ``constraints=`` of
    :func:`cola_jax.cola_od` / :func:`cola_jax.cola_ud` and for
    :func:`cola_jax.project_params`.

  Example:
    >>> import jax.numpy as jnp, cola_jax as cola
    >>> constraints = cola.path_constraints([
    ...     (r'attn/.*/kernel$', cola.Orthogonal()),
    ...     (r'mlp/.*/kernel$', cola.Circle(0.5)),
    ... ])
    >>> params = {'attn': {'query': {'kernel': jnp.eye(3, 2), 'bias': jnp.zeros(2)}},
    ...           'mlp': {'dense': {'kernel': jnp.zeros((2, 2)), 'bias': jnp.zeros(2)}}}
    >>> constraints(params)  # what cola_od/cola_ud compute at init
    {'attn': {'query': {'bias': None, 'kernel': Orthogonal(...)}},
     'mlp': {'dense': {'bias': None, 'kernel': Circle(radius=0.5)}}}
    >>> tx = cola.cola_ud(0.1, friction=1.0, constraints=constraints)
  """
  if isinstance(rules, (str, bytes, Mapping)) or not isinstance(rules, Sequence):
    raise TypeError(f"path_constraints: rules must be a sequence of (regex, constraint) pairs, got {rules!r}.")
  compiled = []
  for i, rule in enumerate(rules):
    if not (isinstance(rule, Sequence) and not isinstance(rule, str) and len(rule) == 2):
      raise TypeError(f"path_constraints: rule {i} must be a (regex, constraint) pair, got {rule!r}.")
    regex, constraint = rule
    if isinstance(regex, re.Pattern):
      pattern = regex
    elif isinstance(regex, str):
      try:
        pattern = re.compile(regex)
      except re.error as error:
        raise ValueError(f"path_constraints: rule {i} has an invalid regex {regex!r}: {error}.") from None
    else:
      raise TypeError(f"path_constraints: the regex of rule {i} must be a string, got {regex!r}.")
    compiled.append((pattern, _check_constraint(constraint, f"the constraint of rule {i} ({regex!r})")))
  return PathConstraints(compiled, _check_constraint(default, "default"))
