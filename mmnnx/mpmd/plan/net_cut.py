"""Alpha-expansion over nets: the task of each free op such that the fewest bytes cross tasks, a
value counting once per task receiving it. Each move is one min cut (scipy's maximum_flow), a net
with several readers joined through one extra node per task (Lawler's hypergraph gadget)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

import numpy as np

from mmnnx.sharding import Task

_MAX_CAPACITY = 2**20  # an edge's capacity once scaled (maximum_flow takes int32)
_MAX_FLOW = 2**30  # the total capacity out of the source once scaled (the flow is int32 too)


@dataclasses.dataclass(frozen=True)
class Net:
    """A value that crosses to each task its readers are on, but not its source's, once. ``source``
    and ``readers`` are op indices or tasks (an input's or output's home)."""

    source: int | Task
    readers: tuple[int | Task, ...]
    nbytes: int


@dataclasses.dataclass
class NetCut:
    """Nets as arrays over nodes: ops ``0..num_ops-1``, then one node per task (a fixed end)."""

    tasks: list[Task]
    labels: np.ndarray  # int64, ops then task nodes (whose labels never change)
    free: np.ndarray  # bool per node
    source: np.ndarray  # int64 node per net
    weight: np.ndarray  # int64 bytes per net
    pin_net: np.ndarray  # int64: the net of each (net, reader) pair
    pin_node: np.ndarray  # int64: the reader of each pair
    num_ops: int

    @classmethod
    def of(
        cls,
        tasks: Sequence[Task],
        nets: Sequence[Net],
        labels: Sequence[Task],
        fixed: Collection[int],
    ) -> NetCut:
        known = list(tasks)
        number = {id(t): i for i, t in enumerate(known)}
        ends = (x for net in nets for x in (net.source, *net.readers) if not isinstance(x, int))
        for t in [*labels, *ends]:
            if id(t) not in number:
                number[id(t)] = len(known)
                known.append(t)
        n = len(labels)

        def node(x: int | Task) -> int:
            return x if isinstance(x, int) else n + number[id(x)]

        free = np.ones(n + len(known), dtype=bool)
        free[n:] = False
        free[list(fixed)] = False
        return cls(
            tasks=known,
            labels=np.array([number[id(t)] for t in labels] + list(range(len(known))), np.int64),
            free=free,
            source=np.array([node(net.source) for net in nets], dtype=np.int64),
            weight=np.array([net.nbytes for net in nets], dtype=np.int64),
            pin_net=np.array([i for i, net in enumerate(nets) for _ in net.readers], np.int64),
            pin_node=np.array([node(r) for net in nets for r in net.readers], dtype=np.int64),
            num_ops=n,
        )

    def tasks_of_ops(self) -> tuple[Task, ...]:
        return tuple(self.tasks[i] for i in self.labels[: self.num_ops])

    def crossing(self) -> int:
        labels = self.labels
        reader = labels[self.pin_node]
        away = reader != labels[self.source][self.pin_net]
        pairs = np.unique(self.pin_net[away] * len(self.tasks) + reader[away])
        return int(self.weight[pairs // len(self.tasks)].sum())

    def expand(self, alpha: int) -> bool:
        """Switches the cheapest free ops to task ``alpha``; ``True`` if fewer bytes cross."""
        movable = self.free & (self.labels != alpha)
        n = int(movable.sum())
        if not n:
            return False
        before = self.crossing()
        network = _move_edges(self, movable, alpha)
        if network is None:
            return False
        switch = np.flatnonzero(movable)[~_source_side(*network, source=n)[:n]]
        if not len(switch):
            return False
        old = self.labels[switch].copy()
        self.labels[switch] = alpha
        if self.crossing() >= before:
            self.labels[switch] = old
            return False
        return True


def _move_edges(
    cut: NetCut, movable: np.ndarray, alpha: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
    """The flow network of one move (edge rows, columns, capacities, node count: the movable
    ops, the source, the sink, then hubs), or ``None`` when no edge depends on the move. An op
    left on the source's side keeps its task, one on the sink's side switches to ``alpha``."""
    n = int(movable.sum())
    index = np.full(len(cut.labels), -1, dtype=np.int64)
    index[movable] = np.arange(n)
    source, sink = n, n + 1
    labels, num_tasks = cut.labels, len(cut.tasks)
    src_label, src_free, src_index = labels[cut.source], movable[cut.source], index[cut.source]
    reader_label, reader_free = labels[cut.pin_node], movable[cut.pin_node]
    reader_index = index[cut.pin_node]
    parts = []

    # readers on a task t other than alpha: one group per (net, t)
    on_t = reader_label != alpha
    keys, group = np.unique(cut.pin_net[on_t] * num_tasks + reader_label[on_t], return_inverse=True)
    net, task = keys // num_tasks, keys % num_tasks
    fixed = np.zeros(len(keys), dtype=bool)
    fixed[group[~reader_free[on_t]]] = True
    members = _Members(group=group, free=reader_free[on_t], index=reader_index[on_t], fixed=fixed)
    at_source = task == src_label[net]
    # t is the source's: paid when the source switches while a reader stays
    parts.append(members.hubs(cut.weight[net], at_source & src_free[net], src_index[net], source))
    # t is not the source's: paid when a reader stays (and anyway when one is fixed there)
    elsewhere = ~at_source & ~fixed
    parts.append(members.hubs(cut.weight[net], elsewhere, np.full(len(net), sink), source))

    # readers on alpha after the move: one group per net, its movable readers (they may switch)
    fixed = np.zeros(len(cut.weight), dtype=bool)
    fixed[cut.pin_net[reader_label == alpha]] = True
    members = _Members(
        group=cut.pin_net, free=reader_free, index=reader_index, fixed=fixed, switch=True
    )
    # a free source: paid when it stays while a reader is on alpha
    parts.append(members.hubs(cut.weight, src_free, src_index, sink))
    # a fixed source on another task: paid when a reader switches (anyway when one is fixed)
    away = ~src_free & (src_label != alpha) & ~fixed
    parts.append(members.hubs(cut.weight, away, np.full(len(cut.weight), source), sink))

    rows, cols, caps, size = [], [], [], n + 2
    for r, c, w, hubs in parts:
        rows.append(np.where(r >= _NEW, r - _NEW + size, r))
        cols.append(np.where(c >= _NEW, c - _NEW + size, c))
        caps.append(w)
        size += hubs
    rows, cols, caps = np.concatenate(rows), np.concatenate(cols), np.concatenate(caps)
    if not len(caps):
        return None
    return rows, cols, caps, size


_NEW = 2**40  # hubs are numbered from here until _move_edges renumbers them


@dataclasses.dataclass
class _Members:
    """Groups of a move's readers, charged when a reader stays (``switch``: switches)."""

    group: np.ndarray
    free: np.ndarray
    index: np.ndarray
    fixed: np.ndarray
    switch: bool = False

    def hubs(
        self, weight: np.ndarray, use: np.ndarray, outer: np.ndarray, terminal: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Edges charging group ``g`` its ``weight[g]`` where ``use[g]``, when a reader stays
        while node ``outer[g]`` switches (with ``switch``: the reverse), through a hub: the
        ``terminal`` where a reader is fixed, the reader itself where it is the only one, else
        a new node (numbered from ``_NEW``). Returns rows, columns, capacities, new nodes."""
        count = np.bincount(self.group[self.free], minlength=len(self.fixed))
        single = np.full(len(self.fixed), -1, dtype=np.int64)
        np.maximum.at(single, self.group[self.free], self.index[self.free])
        use = use & (self.fixed | (count > 0))
        hub = np.where(self.fixed, terminal, np.where(count == 1, single, -1))
        new = use & (hub < 0)
        hub[new] = _NEW + np.arange(int(new.sum()))
        g = np.flatnonzero(use)
        pins = np.flatnonzero(self.free & new[self.group])
        reader, pin_hub = self.index[pins], hub[self.group[pins]]
        if self.switch:  # outer -> hub -> readers: cut when outer stays and a reader switches
            rows = np.concatenate([outer[g], pin_hub])
            cols = np.concatenate([hub[g], reader])
        else:  # readers -> hub -> outer: cut when a reader stays and outer switches
            rows = np.concatenate([hub[g], reader])
            cols = np.concatenate([outer[g], pin_hub])
        caps = np.concatenate([weight[g], weight[self.group[pins]]])
        return rows, cols, caps, int(new.sum())


def _source_side(
    rows: np.ndarray, cols: np.ndarray, caps: np.ndarray, size: int, source: int
) -> np.ndarray:
    """Which of ``size`` nodes a min cut from ``source`` to ``source + 1`` leaves on its side."""
    from scipy.sparse import csr_matrix  # noqa: PLC0415  (slow to import: only for a cut)
    from scipy.sparse.csgraph import breadth_first_order, maximum_flow  # noqa: PLC0415

    keys, inverse = np.unique(rows * size + cols, return_inverse=True)
    summed = np.bincount(inverse, weights=caps, minlength=len(keys))
    rows, cols = keys // size, keys % size
    out_of_source = float(summed[rows == source].sum())
    scale = max(1.0, float(summed.max()) / _MAX_CAPACITY, out_of_source / _MAX_FLOW)
    scaled = np.maximum(1, summed // scale).astype(np.int32)
    capacity = csr_matrix((scaled, (rows, cols)), shape=(size, size))
    flow = maximum_flow(capacity, source, source + 1).flow
    residual = (capacity - flow).tocsr()
    residual.data = (residual.data > 0).astype(np.int8)
    residual.eliminate_zeros()
    reached = np.zeros(size, dtype=bool)
    reached[breadth_first_order(residual, source, directed=True, return_predecessors=False)] = True
    return reached
