"""Parameter grids as pairwise covering sets: the full product stays under ``-m slow``.

A kernel test over several independent axes (combiner x weights x width x
rows) catches an axis's bug with any case that has the value, and a bug of
two axes together with any case that has the pair: every pair of values of
every two axes appears in CI. The rest of the product runs with ``-m slow``.
"""

import itertools

import pytest


def _pairs(case):
  return {((i, case[i]), (j, case[j])) for i, j in itertools.combinations(range(len(case)), 2)}


def pairwise(*axes) -> list[tuple]:
  """A small set of cases of ``itertools.product(*axes)`` holding every pair of values.

  Greedy, deterministic: each step takes the first case of the product that
  covers the most pairs not yet covered.
  """
  product = list(itertools.product(*axes))
  uncovered = set().union(*map(_pairs, product))
  chosen = []
  while uncovered:
    best = max(product, key=lambda case: len(_pairs(case) & uncovered))
    chosen.append(best)
    uncovered -= _pairs(best)
  return chosen


def params(*axes) -> list:
  """Every case of the product; those outside ``pairwise(*axes)`` marked slow."""
  ci = set(pairwise(*axes))
  return [pytest.param(*case, marks=() if case in ci else pytest.mark.slow)
          for case in itertools.product(*axes)]


def each_value_once(*axes) -> list:
  """Every case of the product; CI runs case k = (axis[k % len(axis)], ...).

  Each value of each axis appears in CI once at least; ``-m slow`` runs the
  rest. For two axes, where `params` would keep the whole product.
  """
  ci = {tuple(axis[k % len(axis)] for axis in axes) for k in range(max(map(len, axes)))}
  return [pytest.param(*case, marks=() if case in ci else pytest.mark.slow)
          for case in itertools.product(*axes)]
