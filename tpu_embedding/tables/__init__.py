"""Table stores: every layout a table can have, behind one interface.

See ``base.py`` for the interface. Layouts: ``WholeTable`` (one device),
``RowShardedTable`` (row blocks on this process's devices),
``MultiWorkerShardedTable`` (row blocks over workers), ``ReplicatedTable``
(a copy per replica), ``tiered.TieredTable`` and
``tiered_sharded.TieredShardedTable`` (on a local disk: ``DiskTier``).

Example:
  >>> from tpu_embedding import tables
  >>> sorted(s.layout for s in (tables.WholeTable, tables.ReplicatedTable))
  ['replicated', 'whole']
"""

from tpu_embedding.tables.base import TableStore
from tpu_embedding.tables.base import row_reader
from tpu_embedding.tables.multi_worker import MultiWorkerShardedTable
from tpu_embedding.tables.replicated import ReplicatedTable
from tpu_embedding.tables.row_sharded import RowShardedTable
from tpu_embedding.tables.whole import WholeTable

__all__ = [
  "MultiWorkerShardedTable",
  "ReplicatedTable",
  "RowShardedTable",
  "TableStore",
  "WholeTable",
  "row_reader",
]
