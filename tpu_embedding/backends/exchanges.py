"""How the replicas of sharded tables exchange ids, rows and gradients.

A step on row-sharded tables has two exchanges: each replica's distinct
ids must reach the replicas owning their rows and the rows must come back
(lookup); each replica's gradients must reach the owners of their
rows (update). ``ShardedBackend`` picks one implementation when it is
built:

* ``AllToAll`` — every replica in this process (``MirroredStrategy``, or a
  one-worker ``MultiWorkerMirroredStrategy``). Each replica splits its ids
  by owner and sends each owner only that owner's ids; the owner gathers
  them from its block and sends each replica only its rows. A step touches
  every row once whatever the replica count: ``R`` replicas each handle
  ``1/R`` of the work instead of all of it. The routing is a
  ``merge_call`` handing each replica's per-owner lists to the owners:
  tensors move between the devices of one process, no collective op.
* ``AllGather`` — replicas on several workers. Every replica all-gathers
  all replicas' ids (and gradients) and keeps those it owns; rows come back
  through an all-reduce that adds only zeros to each owned row. The
  collectives span the workers (``collectives.py``); every replica
  handles every replica's rows.

Rows are those of one device exactly. Updates: ``AllToAll`` sends each
owner the ids of its occurrences and their positions among the sender's
gradient rows, which are handed over whole (not split or copied); an owner
sums a row's occurrences in the global batch's order from zero, as one
device does (bit for bit when a table's occurrences come from one
feature); ``AllGather`` adds the replicas' per-id sums in replica order
(equal up to float rounding).

Which replica holds which rows is the stores' to say (their layouts':
``TableStore.split_ids``, ``owned_rows``); an exchange reads and writes
a replica's rows through its store (``gather_block``, ``update_block``).

Example (one replica, whose copy applies its own update):
  >>> import tensorflow as tf
  >>> import tpu_embedding as tpe
  >>> from tpu_embedding.kernels.ops import TENSORFLOW_OPS
  >>> strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
  >>> with strategy.scope():
  ...   emb = tpe.TPUEmbedding(
  ...       tpe.FeatureConfig(tpe.TableConfig(5, 1, name="t",
  ...                         initializer=tpe.RowIdInitializer())),
  ...       tpe.SGD(0.5))
  >>> emb.build()
  >>> update = StoreUpdate(
  ...     emb.table_stores["t"], tf.constant([4, 1], tf.int64),
  ...     RowGradients.dense(tf.ones([2, 1])), None)
  >>> strategy.run(lambda: AllToAll(0, 1).update(0, [update], TENSORFLOW_OPS))
  >>> emb.table_stores["t"].read().numpy()[:, 0].tolist()
  [0.0, 0.5, 2.0, 3.0, 3.5]
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import NamedTuple

import tensorflow as tf

from tpu_embedding.backends.collectives import Exchange
from tpu_embedding.backends.collectives import group_by_width
from tpu_embedding.gradients import PickedRows
from tpu_embedding.gradients import RowGradients
from tpu_embedding.gradients import concat
from tpu_embedding.gradients import summed_gradients
from tpu_embedding.kernels.ops import StepOps
from tpu_embedding.lookup import occurrence_rows
from tpu_embedding.tables.base import TableStore


class ExchangeRequest(NamedTuple):
  """This replica's lookup of one row-sharded table (or stack).

  Attributes:
    store: the table's store.
    ids: ``[n]`` this replica's distinct int64 ids of the table.
    index: ``[m]`` int32, the position in ``ids`` of each occurrence.
  """

  store: TableStore
  ids: tf.Tensor
  index: tf.Tensor


#: Each table's ``ExchangeRequest`` (``RowExchange.gather``).
RowRequests = Sequence[ExchangeRequest]


class StoreUpdate(NamedTuple):
  """This replica's update of one table (or stack), with its store.

  Attributes:
    store: the table's store (it says which replicas hold which rows).
    ids: ``[n]`` this replica's distinct int64 ids of the table.
    gradients: their gradients, as in ``backends.base.TableUpdate``:
      summed per id (``id_index`` None) or one per occurrence.
    id_index: None, or the position in ``ids`` of each occurrence.
  """

  store: TableStore
  ids: tf.Tensor
  gradients: RowGradients
  id_index: tf.Tensor | None


#: Each table's ``StoreUpdate`` (``RowExchange.update``).
GradientUpdates = Sequence[StoreUpdate]


class RowExchange(metaclass=abc.ABCMeta):
  """Moves ids, rows and gradients between the replicas of one step.

  Called inside ``strategy.run`` (replica context) by every replica.

  Args:
    first_local: global id of this process's first replica.
  """

  def __init__(self, first_local: int):
    self._first = first_local

  @abc.abstractmethod
  def gather(
    self, replica: int, requests: RowRequests, ops: StepOps
  ) -> list[PickedRows]:
    """Per request, the ``[m, dim]`` row of each id occurrence (the rows
    of its ids, from their owners, at ``index``), by the step's row ops
    ``ops`` (``kernels/ops.py``)."""

  @abc.abstractmethod
  def update(
    self, replica: int, updates: GradientUpdates, ops: StepOps
  ) -> None:
    """Applies every replica's gradients on the rows ``replica`` holds,
    by the step's row ops ``ops``."""

  def _apply_owned(
    self,
    replica: int,
    store: TableStore,
    rows: tf.Tensor,
    grads: RowGradients,
    ops: StepOps,
  ) -> None:
    """Applies ``grads`` (pieces, in replica order) to ``rows`` of
    ``replica``'s block.

    Duplicates (the same row from several replicas) are summed by the
    update in the order given, from zero (the fused kernel where it
    applies).
    """
    rows, index = ops.unique(rows)
    store.update_block(replica - self._first, rows, grads, index, ops)


class AllToAll(RowExchange):
  """Each replica sends each owner only its ids and gets only its rows.

  Args:
    first_local: global id of this process's first replica (0: every
      replica of the strategy runs in this process).
    num_replicas: replicas in sync.
  """

  def __init__(self, first_local: int, num_replicas: int):
    super().__init__(first_local)
    self._num_replicas = num_replicas

  def gather(
    self, replica: int, requests: RowRequests, ops: StepOps
  ) -> list[PickedRows]:
    splits = [
      request.store.split_ids(request.ids, ops, slots=True)
      for request in requests
    ]
    local = replica - self._first
    replies = []
    for request, received in zip(
      requests, self._route([split.ids for split in splits]), strict=True
    ):
      replies.append(request.store.gather_block_lists(local, received, ops))
    # Each occurrence's row, in place in the owners' replies (its distinct
    # id's slot in their concatenation).
    return [
      PickedRows.at(rows, tf.gather(split.slots, request.index))
      for request, split, rows in zip(
        requests, splits, self._route(replies), strict=True
      )
    ]

  def update(
    self, replica: int, updates: GradientUpdates, ops: StepOps
  ) -> None:
    n = self._num_replicas
    lists, shapes = [], []
    for update in updates:
      # One id per gradient row (the occurrences ids[index]), as a row of
      # its owner's block, with the gradient row's position (a replicated
      # table: every copy gets every one, the same tensors).
      split = update.store.split_ids(
        update.ids, ops, update.id_index, positions=True
      )
      id_parts, where = split.ids, split.positions
      # The gradients travel whole (handed over, never copied or split):
      # an owner picks its rows out by position (and scales them).
      gradients = update.gradients
      # Positions given to several owners (copies) are picked once.
      picked_at: dict[int, PickedRows] = {}
      for at in where:
        if id(at) not in picked_at:
          picked_at[id(at)] = gradients.picked(at)
      picked = [picked_at[id(at)] for at in where]
      where = [p.picks for p in picked]
      scales = [p.factors for p in picked] if gradients.scales else None
      shapes.append((len(gradients.pieces), scales is not None))
      lists += [id_parts, where] + ([scales] if scales else [])
      lists += [[g] * n for g in gradients.pieces]
    received = iter(self._route(lists))
    for update, (count, scaled) in zip(updates, shapes, strict=True):
      occurrences, where = next(received), next(received)
      scales = next(received) if scaled else None
      # Per piece, per source: every source's gradients, whole. The rows
      # sent here are picked out of them in place, one group of positions
      # (and scales) per source, sources in replica order: the occurrences
      # of the global batch in order, each pointing at its distinct row.
      grads = [next(received) for _ in range(count)]
      by_source = [p for pieces in zip(*grads, strict=True) for p in pieces]
      sent = RowGradients.grouped(by_source, where, scales or ())
      self._apply_owned(replica, update.store, occurrences, sent, ops)

  def _route(self, lists: list[list[tf.Tensor]]) -> list[list[tf.Tensor]]:
    """Hands each replica's per-destination lists to the destinations.

    Id lists of one kind bound for one other replica travel as one tensor
    (concatenated here, split there): a step moves a few id tensors
    between each pair of replicas however many tables there are. Rows and
    gradients move as they are (between devices of one process a tensor
    is handed over, not copied; concatenating them would copy).

    Args:
      lists: lists of ``num_replicas`` tensors, the one at ``[d]`` bound
        for replica ``d``.

    Returns:
      Per list, ``num_replicas`` tensors: at ``[s]`` the one replica ``s``
      sent here.
    """
    n = self._num_replicas
    if n == 1:
      return lists
    context = tf.distribute.get_replica_context()
    here = int(tf.get_static_value(context.replica_id_in_sync_group))
    kinds: dict[tuple[object, ...], list[int]] = {}
    for k, dests in enumerate(lists):
      if dests[0].dtype.is_integer:
        key: tuple[object, ...] = (
          dests[0].dtype,
          tuple(dests[0].shape[1:].as_list()),
        )
      else:  # Rows and gradients: passed as they are, never copied.
        key = (k,)
      kinds.setdefault(key, []).append(k)
    groups = list(kinds.values())
    # Lists that travel together also send their sizes, to be split apart.
    together = [g for g, group in enumerate(groups) if len(group) > 1]
    packed: list[list[tf.Tensor]] = []
    sizes: list[list[tf.Tensor]] = [[] for _ in together]
    for g, group in enumerate(groups):
      packed.append([])
      for dest in range(n):
        parts = [lists[k][dest] for k in group]
        if dest == here:  # Stays here: an empty stand-in travels.
          parts = [_no_rows_like(parts[0])]
        packed[-1].append(concat(parts))
        if g in together:
          sizes[together.index(g)].append(
            tf.stack([_row_count(p) for p in parts])
          )
    got = context.merge_call(_transpose, args=(packed + sizes,))[here]
    received: list[list[tf.Tensor | None]] = [[None] * n for _ in lists]
    for g, group in enumerate(groups):
      for source in range(n):
        if source == here:
          pieces = [lists[k][here] for k in group]
        elif len(group) == 1:
          pieces = [got[g][source]]
        else:
          split = got[len(groups) + together.index(g)][source]
          pieces = tf.split(got[g][source], split, num=len(group))
        for k, piece in zip(group, pieces, strict=True):
          received[k][source] = piece
    return received


# A step's exchanges size and stand in for many small tensors: one op each
# where the shapes allow, not a shape, a slice and its constants (a traced
# 2-replica step of 26 tables held some 2,000 such ops).


def _row_count(t: tf.Tensor) -> tf.Tensor:
  """``tf.shape(t)[0]``, in one op for a vector."""
  return tf.size(t) if t.shape.rank == 1 else tf.shape(t)[0]


def _no_rows_like(t: tf.Tensor) -> tf.Tensor:
  """``t[:0]``: a constant where ``t``'s row shape is static."""
  if t.shape[1:].is_fully_defined():
    return tf.zeros([0, *t.shape[1:].as_list()], t.dtype)
  return t[:0]


def _transpose(
  strategy: tf.distribute.Strategy, lists: list[list[tf.Tensor]]
) -> list[list[list[tf.Tensor]]]:
  """In cross-replica context: per destination, what every source sent.

  ``lists[k][d]`` is a per-replica value (one tensor per source); the
  result's ``[d][k][s]`` is source ``s``'s tensor of list ``k`` for ``d``.
  """
  num = strategy.num_replicas_in_sync

  def by_source(value: tf.Tensor) -> tuple[tf.Tensor, ...]:
    values = tuple(strategy.experimental_local_results(value))
    return values if len(values) == num else values * num

  sent = [[by_source(value) for value in dests] for dests in lists]
  return [
    [[dests[dest][s] for s in range(num)] for dests in sent]
    for dest in range(num)
  ]


class AllGather(RowExchange):
  """Every replica sees every replica's ids and gradients (collectives).

  Works across workers: the all-gathers and all-reduces are
  ``ReplicaContext`` collectives, batched over tables (``Exchange``).
  """

  def gather(
    self, replica: int, requests: RowRequests, ops: StepOps
  ) -> list[PickedRows]:
    context = tf.distribute.get_replica_context()
    id_lists = [request.ids for request in requests]
    exchange = Exchange(context, id_lists)
    rows = []
    for request, all_ids in zip(
      requests, exchange.all_gather(id_lists, -1), strict=True
    ):
      store = request.store
      in_block, mine = store.owned_rows(tf.reshape(all_ids, [-1]), replica)
      # (TensorFlow's gather: the same rows as any ops')
      found = store.gather_block(replica - self._first, in_block)
      rows.append(tf.where(mine[:, None], found, tf.zeros_like(found)))
    results: dict[int, PickedRows] = {}
    # Each row is non-zero on its owner only: the sum is exact.
    widths = [request.store.table.dim for request in requests]
    for group in group_by_width(widths):
      summed = exchange.all_reduce_rows([rows[k] for k in group], group)
      for k, value in zip(group, summed, strict=True):
        results[k] = occurrence_rows(value, requests[k].index)
    return [results[k] for k in range(len(requests))]

  def update(
    self, replica: int, updates: GradientUpdates, ops: StepOps
  ) -> None:
    context = tf.distribute.get_replica_context()
    # Each replica's gradients summed per id before they travel.
    sums = [
      summed_gradients(update.ids, update.gradients, update.id_index)
      for update in updates
    ]
    id_lists = [update.ids for update in updates]
    exchange = Exchange(context, id_lists)
    all_ids = exchange.all_gather(id_lists, -1)
    all_grads: list[tf.Tensor | None] = [None] * len(updates)
    for group in group_by_width([update.store.table.dim for update in updates]):
      gathered = exchange.all_gather(
        [sums[k] for k in group], 0.0, tables=group
      )
      for k, grads in zip(group, gathered, strict=True):
        all_grads[k] = grads
    for update, ids, grads in zip(updates, all_ids, all_grads, strict=True):
      store = update.store
      in_block, mine = store.owned_rows(tf.reshape(ids, [-1]), replica)
      self._apply_owned(
        replica,
        store,
        tf.boolean_mask(in_block, mine),
        RowGradients.dense(
          tf.boolean_mask(tf.reshape(grads, [-1, store.table.dim]), mine)
        ),
        ops,
      )
