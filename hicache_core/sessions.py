"""Sessions: which cached prefixes a live conversation will probably ask for again.

A request may carry a session id (a multi-turn conversation, an agent loop). When such a request
finishes, the deepest tree node its sequence reached is *referenced* by the session. Eviction
(see :meth:`~hicache_core.radix_tree.RadixTree.evict_device` and ``evict_host``) takes nodes
that no session references first, least recently used first, and only then referenced ones,
also least recently used first: a reference is a preference, never a pin, so sessions cannot
starve the pools. A node counts as referenced when it or any descendant is referenced directly
(the session's next round reads the whole path).

Lifecycle:

* A session opens implicitly with the first :meth:`SessionTable.ticket` for its id; the ticket
  captures the session's epoch (a request takes one when it is submitted).
* :meth:`SessionTable.reference` (a request finished) adds the reference only if the ticket's
  epoch is still the session's: a request submitted before :meth:`SessionTable.close` and
  finishing after it adds nothing, even if a new session has since opened under the same id.
* :meth:`SessionTable.close` drops the session's references; the cached data stays (it is
  ordinary LRU data from then on).

Bounds: a session holds at most ``nodes_per_session`` references (its latest requests' nodes;
the oldest is dropped first, and a request ending on a node the session already holds moves it
to the newest place without counting twice); at most ``max_sessions`` sessions are open at once
(opening one more closes the least recently active one).

A reference dies with its node: when eviction deletes a node from the tree the session's record
of it is skipped (a deleted node has no parent) and forgotten the next time the session changes.
A split keeps the reference on the lower node, which keeps its identity and end (the referenced
boundary), so references need no fixing up.

Not thread-safe: the scheduler thread owns the table, like the tree.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from hicache_core.radix_tree import RadixTree, TreeNode

#: References one session holds by default: its latest requests' deepest nodes.
NODES_PER_SESSION = 4
#: Open sessions by default; one more closes the least recently active.
MAX_SESSIONS = 4096


@dataclass(frozen=True)
class SessionTicket:
    """What a request holds from submission to completion: its session and that session's epoch."""

    session_id: str
    epoch: int


class _Session:
    __slots__ = ("epoch", "nodes")

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        # Referenced nodes, oldest first (an ordered set: TreeNode hashes by identity).
        self.nodes: OrderedDict[TreeNode, None] = OrderedDict()


class SessionTable:
    """The open sessions of one tree and the node references they hold (see the module docstring)."""

    def __init__(
        self, tree: RadixTree, *, nodes_per_session: int = NODES_PER_SESSION, max_sessions: int = MAX_SESSIONS
    ) -> None:
        if nodes_per_session < 1 or max_sessions < 1:
            raise ValueError(
                f"nodes_per_session ({nodes_per_session}) and max_sessions ({max_sessions}) must be at least 1"
            )
        self.tree = tree
        self.nodes_per_session = nodes_per_session
        self.max_sessions = max_sessions
        # Least recently active first.
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        # Epochs are unique across the table's life, so a ticket from a closed session never
        # matches a later session reopened under the same id.
        self._epochs = itertools.count()

    def ticket(self, session_id: str) -> SessionTicket:
        """The ticket a request carries from submission; opens the session if it is not open."""
        session = self._sessions.get(session_id)
        if session is None:
            while len(self._sessions) >= self.max_sessions:
                self.close(next(iter(self._sessions)))
            session = self._sessions[session_id] = _Session(next(self._epochs))
        else:
            self._sessions.move_to_end(session_id)
        return SessionTicket(session_id, session.epoch)

    def is_current(self, ticket: SessionTicket) -> bool:
        """Whether the ticket's session is open and still in the epoch the ticket was taken in."""
        session = self._sessions.get(ticket.session_id)
        return session is not None and session.epoch == ticket.epoch

    def reference(self, ticket: SessionTicket, node: TreeNode) -> bool:
        """Reference ``node`` (the deepest node a finished request reached) from the ticket's session.

        Returns False, and changes nothing, when the session was closed (or closed and reopened)
        since the ticket was taken, or when ``node`` is the root or no longer in the tree.
        """
        if not self.is_current(ticket) or not self.tree.in_tree(node):
            return False
        self._sessions.move_to_end(ticket.session_id)
        nodes = self._sessions[ticket.session_id].nodes
        if node in nodes:
            nodes.move_to_end(node)
            return True
        self.tree.add_session_ref(node)
        for dead in [n for n in nodes if not self.tree.in_tree(n)]:
            del nodes[dead]
        nodes[node] = None
        while len(nodes) > self.nodes_per_session:
            oldest, _ = nodes.popitem(last=False)
            self.tree.drop_session_ref(oldest)
        return True

    def close(self, session_id: str) -> bool:
        """Drop the session's references (the cached data stays) and end its epoch.

        Returns whether the session was open; closing an unknown or closed session is a no-op.
        """
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        for node in session.nodes:
            self.tree.drop_session_ref(node)
        session.nodes.clear()
        return True

    def referenced_nodes(self, session_id: str) -> list[TreeNode]:
        """The nodes the session references that are still in the tree, oldest first."""
        session = self._sessions.get(session_id)
        if session is None:
            return []
        return [n for n in session.nodes if self.tree.in_tree(n)]

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)
