"""The kinds of lock (issue 12), one module each.

* :mod:`dblock.kinds.exclusive`: the exclusive lock's level 2, the row's
  acquire loop: one of the parts :class:`~dblock.lock.Locker` is made of
  (``LockManager.lock``).
* :mod:`dblock.kinds.semaphore`: N permits per key (``LockManager.semaphore``).
* :mod:`dblock.kinds.rw`: read-write locks (``LockManager.read_lock``/``write_lock``).
* :mod:`dblock.kinds.fair`: the fair queue (``LockManager.lock(key, fair=True)``).

Shared conventions (the table since revision 0002, see ``dblock.schema``):
every row has ``(lock_key, slot)`` as its key and carries ``kind``,
``mode``, ``holders`` and ``permits`` next to owner, token, fence and lease.
Slot ``''`` is a key's head row (the exclusive holder, the rw head, the fair
queue's holder); semaphore permits use ``p0`` … ``p{N-1}``; fair-queue
waiters ``q`` + the ticket zero-padded to 20 digits; a rw writer-intent row
``w`` + something. A key is used with one kind: :data:`KINDS` names them,
and a request of another kind raises :class:`~dblock.errors.KindMismatch`.
"""

from __future__ import annotations

# The values live with the table (dblock.schema), a floor below the store,
# which writes them; this package names them for the kinds built on them.
from ..schema import EXCLUSIVE, HEAD_SLOT, KINDS, RW, SEMAPHORE, describe

__all__ = ["EXCLUSIVE", "HEAD_SLOT", "KINDS", "RW", "SEMAPHORE", "describe"]
