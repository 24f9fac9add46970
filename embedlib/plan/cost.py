"""The cost model behind the automatic layout choice: memory and traffic.

Estimates, per device, of the table bytes a layout stores and of the bytes a
lookup moves between devices, using ring-collective volumes (an all-gather
or reduce-scatter over ``k`` ranks moves ``(k - 1) / k`` of the full buffer,
an all-reduce twice that). They rank layouts; they are not a timing model.
"""

from __future__ import annotations

import math

from embedlib import options

ID_BYTES = 4  # ids travel as int32


#: The default route capacity holds the mean ids per destination plus this
#: many standard deviations of a uniform spread of ids over the rows: with
#: 64 ranks (4096 source-destination pairs) a step of uniform ids overflows
#: (and takes the fallback) about once in ten.
ROUTE_SLACK_SIGMAS = 4.0


def padded_shape(num_embeddings, features, strategy, group_size, column_group: int = 1):
  """Physical table shape: the sharded dimension rounded up to the group.

  A grid rounds its rows up to the group and its columns up to the
  ``column_group``.

  >>> padded_shape(50257, 768, "vocab", 8)
  (50264, 768)
  >>> padded_shape(1000, 100, "hidden", 8)
  (1000, 104)
  >>> padded_shape(50257, 100, "grid", 4, 8)
  (50260, 104)
  """
  if strategy == options.GRID:
    return (math.ceil(num_embeddings / group_size) * group_size,
            math.ceil(features / column_group) * column_group)
  if strategy in options.ROW_SHARDED:
    return (math.ceil(num_embeddings / group_size) * group_size, features)
  if strategy == options.HIDDEN:
    return (num_embeddings, math.ceil(features / group_size) * group_size)
  return (num_embeddings, features)


def table_bytes_per_device(padded, strategy, group_size, itemsize, column_group: int = 1) -> int:
  """Bytes of the table shard each device stores.

  >>> table_bytes_per_device((1024, 64), "vocab", 8, 4)
  32768
  >>> table_bytes_per_device((1024, 64), "grid", 4, 4, 2)
  32768
  """
  rows, cols = padded
  if strategy == options.REPLICATED:
    return rows * cols * itemsize
  if strategy == options.GRID:
    return rows * cols * itemsize // (group_size * column_group)
  return rows * cols * itemsize // group_size


def route_ids(ids_per_device: int, rest_ranks: int) -> int:
  """Ids one rank routes: its device's ids, split over the ranks holding the same ones.

  >>> route_ids(1000, 1), route_ids(1000, 4), route_ids(7, 2)
  (1000, 250, 4)
  """
  return math.ceil(ids_per_device / rest_ranks)


def route_capacity(ids: int, shares, *, sigmas: float = ROUTE_SLACK_SIGMAS) -> int:
  """Static ids per destination of a route: the mean plus ``sigmas`` deviations.

  Each of a rank's ``ids`` goes to destination ``d`` with probability
  ``shares[d]`` (its share of the rows, for uniform ids); the count sent to
  ``d`` is binomial. The capacity is the largest over destinations of its
  mean plus ``sigmas`` standard deviations, at least 1 and at most ``ids``
  (which can never overflow).

  Args:
    ids: ids one rank routes (``route_ids``).
    shares: per destination, the fraction of ids it owns (they sum to 1).
    sigmas: the slack, in standard deviations.

  Returns:
    The capacity, in ids per destination.

  >>> route_capacity(8192, [1 / 64] * 64)   # 128 ids per rank on average
  173
  >>> route_capacity(100, [1.0, 0.0])       # one owner: every id, no slack
  100
  """
  worst = 0.0
  for p in shares:
    worst = max(worst, ids * p + sigmas * math.sqrt(ids * p * (1.0 - p)))
  return int(min(ids, max(1, math.ceil(worst - 1e-9))))


def uniform_route_capacity(ids_per_device: int, group: int, rest_ranks: int = 1) -> int:
  """``route_capacity`` of a table split evenly over ``group`` ranks.

  >>> uniform_route_capacity(8192, 64)
  173
  """
  return route_capacity(route_ids(ids_per_device, rest_ranks), [1.0 / group] * group)


def distinct_ids(ids: int, rows: int, skew: float = 0.0) -> tuple[float, float]:
  """Mean and variance of the distinct rows among ``ids`` draws over ``rows``.

  ``skew`` is the exponent of a Zipf law over the rows: row ``k`` (from 1,
  the hottest) drawn with probability proportional to ``k ** -skew``; 0
  draws uniformly, which repeats least. Real ids repeat more: Criteo's
  categoricals, hashed over a table, repeat as a skew near 1 does
  (``embedlib.plan.fit_id_skew`` fits one from a batch of ids).

  The mean is the sum over rows of the chance a row is drawn,
  ``1 - (1 - p_k) ** ids``. The variance is the rows' Bernoulli variances
  less their covariances: two rows compete for the same draws, so one
  drawn makes the other less likely. Each pair's covariance is taken to
  first order, ``-ids * p_j * p_k * m_j * m_k`` with ``m = (1 - p) ** ids
  / (1 - p)``; leaving it out would double the deviation where most ids are
  distinct, and a dedup capacity that holds every id saves nothing.
  Uniform draws give the occupancy count's variance exactly.

  >>> [round(x, 2) for x in distinct_ids(512, 12)]
  [12.0, 0.0]
  >>> round(distinct_ids(100, 1_000_000)[0], 2)
  100.0
  >>> [round(x, 2) for x in distinct_ids(10, 2)]
  [2.0, 0.0]
  >>> round(distinct_ids(16_384, 250_000)[0]), round(distinct_ids(16_384, 250_000, 1.0)[0])
  (15859, 7200)
  """
  if skew < 0 or not math.isfinite(skew):
    raise ValueError(f"skew must be a finite number >= 0, got {skew!r}.")
  if rows <= 1 or ids <= 0:
    return float(min(ids, rows)), 0.0
  if skew == 0:
    q_n = math.exp(ids * math.log1p(-1.0 / rows))
    # Two rows: no draw misses both (and log1p(-1) is undefined).
    q2_n = math.exp(ids * math.log1p(-2.0 / rows)) if rows > 2 else 0.0
    mean = rows * (1.0 - q_n)
    var = rows * q_n + rows * (rows - 1) * q2_n - rows * rows * q_n * q_n
    return mean, max(var, 0.0)
  norm = _zipf_sum(rows, skew, lambda w: w)

  def drawn(w):
    """The chance a row of weight ``w`` is drawn at least once."""
    p = min(w / norm, 1.0)
    missed = math.exp(ids * math.log1p(-p)) if p < 1.0 else 0.0
    return 1.0 - missed

  def competing(w):
    """``p * m`` of a row of weight ``w``: its share of the rows' covariances."""
    p = min(w / norm, 1.0)
    return p * math.exp((ids - 1) * math.log1p(-p)) if p < 1.0 else 0.0

  mean = _zipf_sum(rows, skew, drawn)
  bernoulli = _zipf_sum(rows, skew, lambda w: drawn(w) * (1.0 - drawn(w)))
  pairs = _zipf_sum(rows, skew, competing) ** 2 - _zipf_sum(rows, skew, lambda w: competing(w) ** 2)
  return min(mean, float(ids), float(rows)), max(bernoulli - ids * pairs, 0.0)


#: Rows summed one by one before ``_zipf_sum`` integrates the rest.
_ZIPF_HEAD = 2048
#: The integrated rows' segments grow by this factor: each spans at least
#: ``_ZIPF_HEAD / 32`` rows, over which the terms are smooth.
_ZIPF_STEP = 1.0 + 1.0 / 32


def _zipf_sum(rows: int, skew: float, f) -> float:
  """``sum(f(k ** -skew) for k in 1..rows)``, the tail past ``_ZIPF_HEAD`` by Simpson's rule.

  Pure Python in a few hundred terms for any ``rows`` (a sum over a
  billion rows would not be): each segment ``[a, b)`` of whole rows is the
  integral of ``f((x) ** -skew)`` over ``[a - 1/2, b - 1/2]``.

  >>> round(_zipf_sum(10**6, 1.0, lambda w: w), 4)   # the harmonic number H(10**6)
  14.3927
  """
  head = min(rows, _ZIPF_HEAD)
  total = sum(f(k ** -skew) for k in range(1, head + 1))
  a = head + 1
  while a <= rows:
    b = min(rows + 1, max(a + 1, int(a * _ZIPF_STEP)))
    lo, hi = a - 0.5, b - 0.5
    mid = 0.5 * (lo + hi)
    total += (hi - lo) / 6.0 * (f(lo ** -skew) + 4.0 * f(mid ** -skew) + f(hi ** -skew))
    a = b
  return total


def fit_id_skew(ids: int, distinct: int, rows: int) -> float:
  """The ``skew`` (``distinct_ids``) under which ``ids`` draws over ``rows`` hold ``distinct`` rows.

  Measure a batch of real ids (for one table, every feature reading it
  together, padding left out): ``ids`` of them, ``distinct`` distinct; a
  batch as one data shard sees it is the closest match. The skew found
  makes the planner's distinct-id estimate equal that count at that batch
  and extrapolates it to other batch sizes and shard counts.

  Args:
    ids: the ids counted (>= 1).
    distinct: how many of them are distinct (1 to ``min(ids, rows)``).
    rows: the table's rows.

  Returns:
    The skew, to 1e-3: 0 for ids that repeat no more than uniform ones.

  >>> fit_id_skew(4096, 2070, 100_000)
  1.0
  >>> fit_id_skew(4096, 4030, 100_000)   # about as many as uniform ids give
  0.0
  """
  if not 1 <= ids or not 1 <= distinct <= min(ids, rows):
    raise ValueError(
        f"fit_id_skew: need 1 <= distinct <= min(ids, rows), got ids={ids}, "
        f"distinct={distinct}, rows={rows}; count the distinct ids of one batch of "
        "the table's ids, padding left out.")
  if distinct >= distinct_ids(ids, rows)[0]:
    return 0.0
  lo, hi = 0.0, 8.0
  if distinct <= distinct_ids(ids, rows, hi)[0]:
    return hi
  while hi - lo > 5e-4:
    mid = 0.5 * (lo + hi)
    if distinct_ids(ids, rows, mid)[0] > distinct:
      lo = mid
    else:
      hi = mid
  return round(0.5 * (lo + hi), 3)


def dedup_capacity(members, *, sigmas: float = ROUTE_SLACK_SIGMAS) -> int:
  """Static distinct ids per data shard of a dedup: the mean plus ``sigmas`` deviations.

  Args:
    members: ``(ids, rows)`` or ``(ids, rows, skew)`` per table deduplicated
      together (a stack's members have disjoint rows): ids per data shard,
      the table's rows and its ids' skew (``distinct_ids``; 0 if left out).
    sigmas: the slack, in standard deviations (as for the route's capacity).

  Returns:
    The capacity, at least 1 and at most the ids (which never overflows).

  >>> dedup_capacity([(512, 12), (512, 200_000)])   # 12 + about 511, and slack
  527
  >>> dedup_capacity([(4096, 100_000, 1.0)])        # skewed ids repeat: about 2,070
  2189
  """
  mean = var = total = 0.0
  for ids, rows, *skew in members:
    m, v = distinct_ids(ids, rows, *skew)
    mean, var, total = mean + m, var + v, total + ids
  return int(min(total, max(1, math.ceil(mean + sigmas * math.sqrt(var) - 1e-9))))


#: ``auto`` dedups only where the bytes it saves a device exceed this many per
#: id it deduplicates: its own work on an id (finding it among the distinct
#: ids, then rebuilding its row and gathering its gradient from theirs,
#: beside a ``lax.cond`` and the overflow count) takes about as long as
#: moving that many bytes between devices. Measured on 8 simulated CPU
#: devices, a forward and a training step each (``benchmarks/dedup_cost.py``;
#: ``benchmarks/README.md``, "What dedup pays for"): dedup ran slower saving 4 or 23
#: bytes an id of uniform ids and 63 of Zipf ids (whose repeated rows a
#: lookup without dedup finds in the caches), faster saving 142; so between
#: 63 and 142. A GPU's sort and interconnect are not measured.
DEDUP_BYTES_PER_ID = 96


def dedup_pays(moved: int, moved_dedup: int, ids: int) -> bool:
  """Whether dedup's saving (``moved - moved_dedup`` bytes) pays for its work on ``ids`` ids.

  Args:
    moved: bytes a device receives per step without dedup (weighed as the
      caller weighs its layouts, e.g. a byte across nodes counted
      ``INTER_NODE_WEIGHT`` times).
    moved_dedup: the same with dedup.
    ids: ids one data shard deduplicates per step.

  >>> dedup_pays(1_086_547, 1_070_167, 4096)   # uniform ids over 100,000 rows: 4 bytes an id
  False
  >>> dedup_pays(1_086_547, 500_507, 4096)     # over 2,000 rows: 143 bytes an id
  True
  """
  return moved - moved_dedup > DEDUP_BYTES_PER_ID * ids


def route_bytes(capacity: int, group: int, cols: int, itemsize: int) -> int:
  """Bytes a rank receives in one route: ids out to owners and rows back.

  Two tiled all-to-alls of ``group * capacity`` entries (ids, then rows), of
  which ``(group - 1) / group`` cross devices, and the all-reduce of the
  overflow count (one int32).

  >>> route_bytes(173, 64, 64, 4)
  2833747
  """
  flag = 2 * (group - 1) * ID_BYTES // group
  return flag + (group - 1) * capacity * (ID_BYTES + cols * itemsize)


def gather_pairs_bytes(ids_per_device: int, ranks: int, features: int, itemsize: int) -> int:
  """Bytes a rank receives all-gathering ``(id, row gradient)`` pairs over ``ranks`` data ranks.

  >>> gather_pairs_bytes(512, 64, 64, 4)
  8386560
  """
  return (ranks - 1) * ids_per_device * (ID_BYTES + features * itemsize)


def routed_pairs_bytes(capacity: int, group: int, outer: int, features: int,
                       itemsize: int) -> int:
  """Bytes a rank receives routing ``(id, row gradient)`` pairs to their owners.

  An all-to-all of ``capacity`` pairs per destination over the ``group``,
  then an all-gather of what arrived over the ``outer`` replicas of the
  shard.

  >>> routed_pairs_bytes(100, 8, 1, 64, 4)
  182000
  """
  entry = ID_BYTES + features * itemsize
  return ((group - 1) * capacity + (outer - 1) * group * capacity) * entry


def allreduce_bytes(rows: int, ranks: int, features: int) -> int:
  """Bytes a rank receives all-reducing a ``[rows, features + 1]`` float32 buffer over ``ranks``.

  >>> allreduce_bytes(1000, 64, 64)
  511875
  """
  return 2 * (ranks - 1) * rows * (features + 1) * 4 // ranks


def bytes_moved_per_lookup(
    padded, strategy, *, ids_per_device, token_ranks, rest_ranks, itemsize,
    capacity=None, column_token_ranks: int = 1, column_rest_ranks: int = 1,
) -> int:
  """Bytes one device receives for one lookup of ``ids_per_device`` ids.

  Args:
    padded: physical table shape ``(rows, cols)``.
    strategy: ``"replicated" | "vocab" | "hidden" | "routed"``.
    ids_per_device: ids each device looks up (its share of the batch).
    token_ranks: table ranks that hold different tokens (the token axes).
    rest_ranks: table ranks that hold the same tokens (ids replicated).
    itemsize: bytes per table element.
    capacity: ids per destination of a routed lookup (default
      ``uniform_route_capacity``).
    column_token_ranks, column_rest_ranks: a grid's column ranks holding
      different tokens and the same tokens (its rows use the two above).

  Returns:
    The estimate, in bytes.

  >>> bytes_moved_per_lookup((1000, 64), "hidden", ids_per_device=4096,
  ...                        token_ranks=1, rest_ranks=8, itemsize=4)
  917504
  """
  if strategy == options.REPLICATED:
    return 0
  if strategy == options.GRID:
    return _grid_bytes(padded, ids_per_device, token_ranks, rest_ranks,
                       column_token_ranks, column_rest_ranks, itemsize)
  cols = padded[1]
  local_tokens = ids_per_device
  if strategy == options.ROUTED:
    group = token_ranks * rest_ranks
    if capacity is None:
      capacity = uniform_route_capacity(local_tokens, group, rest_ranks)
    moved = route_bytes(capacity, group, cols, itemsize)
    if rest_ranks > 1:  # rows gathered back over the ranks sharing the ids
      moved += (rest_ranks - 1) * route_ids(local_tokens, rest_ranks) * cols * itemsize
    return moved
  group_tokens = local_tokens * token_ranks
  moved = (token_ranks - 1) * local_tokens * ID_BYTES  # ids all-gather
  if strategy == options.VOCAB:
    full = group_tokens * cols * itemsize
    moved += 2 * (rest_ranks - 1) * full // rest_ranks  # psum over rest
    moved += (token_ranks - 1) * full // token_ranks  # psum_scatter
  else:
    width = cols // (token_ranks * rest_ranks)
    moved += (rest_ranks - 1) * group_tokens * width * itemsize  # all-gather
    # all-to-all of the columns gathered over the rest ranks
    moved += (token_ranks - 1) * local_tokens * width * rest_ranks * itemsize
  return moved


def _grid_bytes(padded, ids, token_ranks, rest_ranks, col_token_ranks, col_rest_ranks,
                itemsize) -> int:
  """A grid lookup: a vocab lookup of its column block, inside a hidden one.

  Ids gathered over the column token ranks, then over the row token ranks;
  each rank's partial rows of its column block summed over the rows'
  group; the column blocks concatenated over the columns' group.

  >>> _grid_bytes((1000, 64), 512, 1, 4, 2, 1, 4)
  264192
  """
  width = padded[1] // (col_token_ranks * col_rest_ranks)
  column_tokens = ids * col_token_ranks
  moved = (col_token_ranks - 1) * ids * ID_BYTES
  moved += (token_ranks - 1) * column_tokens * ID_BYTES
  full = column_tokens * token_ranks * width * itemsize
  moved += 2 * (rest_ranks - 1) * full // rest_ranks + (token_ranks - 1) * full // token_ranks
  moved += (col_rest_ranks - 1) * column_tokens * width * itemsize
  moved += (col_token_ranks - 1) * ids * width * col_rest_ranks * itemsize
  return moved


#: ``auto`` counts a byte that crosses nodes as this many bytes inside one.
#: A device's share of its node's network (a 400 Gb/s NIC per GPU: 50 GB/s)
#: is about a tenth of its NVLink bandwidth (450 GB/s each way on an H100),
#: and a TPU slice's data-center network is slower than its ICI by as much;
#: 8 keeps the choice from swinging on the exact ratio of one cluster.
INTER_NODE_WEIGHT = 8


def node_capacity(capacity: int, devices_per_node: int, rows_per_rank: int, *,
                  skew: float = 0.0, sigmas: float = ROUTE_SLACK_SIGMAS) -> int:
  """Distinct ids per destination rank that one node's ranks send it together.

  The node's ``devices_per_node`` ranks send a destination at most
  ``capacity`` ids each; sent once per node, the repeats among them are
  dropped. Planned for ids of ``skew`` (``distinct_ids``; 0, uniform ids,
  repeats least) over the destination's ``rows_per_rank`` rows, their hot
  rows spread over the ranks as hashed ids are: the mean distinct count of
  the full buffers plus ``sigmas`` deviations, never more than the buffers
  hold.

  >>> node_capacity(173, 8, 7813)   # 1384 ids over 7813 rows: about 1263 distinct
  1307
  >>> node_capacity(173, 8, 7813, skew=1.0)   # skewed ids repeat across the node's ranks
  706
  >>> node_capacity(173, 8, 100)    # a small shard: each row once per node
  100
  """
  return min(rows_per_rank, dedup_capacity(
      [(capacity * devices_per_node, rows_per_rank, skew)], sigmas=sigmas))


def node_route_bytes(capacity: int, node_cap: int, group: int, devices_per_node: int,
                     cols: int, itemsize: int) -> tuple[int, int]:
  """``(intra-node, inter-node)`` bytes a rank receives in one two-level route.

  Ids out: an all-to-all inside the node of ``group * capacity`` ids, then
  one across the nodes of ``node_cap`` distinct ids per destination rank;
  rows back the same way reversed. The group's two overflow counts (an
  all-reduce each) split as every group collective does
  (``inter_node_share``).

  >>> node_route_bytes(173, 400, 64, 8, 64, 4)
  (2518880, 728014)
  """
  nodes = group // devices_per_node
  entry = ID_BYTES + cols * itemsize
  flag = 2 * (group - 1) * ID_BYTES // group
  flag_inter = 2 * (group - devices_per_node) * ID_BYTES // group
  intra = (devices_per_node - 1) * nodes * capacity * entry + 2 * (flag - flag_inter)
  inter = (nodes - 1) * node_cap * entry + 2 * flag_inter
  return intra, inter


def node_route_pays(capacity: int, node_cap: int, group: int, devices_per_node: int) -> bool:
  """Whether the two-level route moves fewer weighed bytes than the flat one.

  Per destination rank: the flat route's ``capacity`` entries from each
  other rank against the two-level route's ``capacity`` from each rank of
  the node and ``node_cap`` distinct ones from each other node, an entry
  crossing nodes counted ``INTER_NODE_WEIGHT`` times. It pays when the
  node's ranks repeat each other's ids enough; uniform ids over a large
  table don't.

  >>> node_route_pays(173, 1307, 64, 8), node_route_pays(173, 400, 64, 8)
  (False, True)
  """
  per, nodes = devices_per_node, group // devices_per_node
  flat = INTER_NODE_WEIGHT * (nodes - 1) * per * capacity + (per - 1) * capacity
  two = INTER_NODE_WEIGHT * (nodes - 1) * node_cap + (per - 1) * nodes * capacity
  return two < flat


def inter_node_share(group: int, devices_per_node: int | None) -> float:
  """The share of a group collective's bytes that cross nodes (each peer sends as much).

  >>> inter_node_share(64, 8), inter_node_share(8, None)
  (0.8888888888888888, 0.0)
  """
  if not devices_per_node or devices_per_node >= group or group < 2:
    return 0.0
  return (group - devices_per_node) / (group - 1)
