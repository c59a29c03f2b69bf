"""Sends to other processes offered as soon as their value is made (``run/early_sends.py``); the
two-process runs that depend on it are in test_distributed.py."""

import dataclasses

from mmnnx.mpmd.run.early_sends import send_early
from mmnnx.mpmd.run.emit import Cross, Launch, _writes


@dataclasses.dataclass
class Route:
    """The part of a route plan the pass reads: which ends this process holds, and the peers
    it sends to."""

    sends: bool = True
    receives: bool = False
    outgoing_peers: tuple[int, ...] = (1,)
    gathers: bool = False


def launch(name, args=(), results=(), drop=()):
    return Launch(program=name, args=args, results=results, labels=(), rank="t0", drop=drop)


def cross(source, peers=(1,), receives=False, drop=(), gathers=False):
    route = Route(sends=not receives, receives=receives, outgoing_peers=peers, gathers=gathers)
    return Cross(route=route, source=source, target=100 + source, drop=drop)


def names(steps):
    return [s.program if isinstance(s, Launch) else f"cross {s.source}" for s in steps]


def test_a_send_moves_up_to_its_value_and_leaves_its_releases_where_they_were():
    steps = [launch("f0", results=(1,)), launch("f1", results=(2,)),
             cross(9, receives=True), launch("b0", args=(1,)), cross(1, drop=(1,))]  # fmt: skip
    out = send_early(steps, Cross, _writes)
    assert names(out) == ["f0", "cross 1", "f1", "cross 9", "b0"]
    assert out[1].drop == () and out[-1].drop == (1,)  # b0 still reads slot 1


def test_a_send_never_passes_an_earlier_send_to_the_same_peer():
    steps = [launch("f0", results=(1, 2)), launch("g", results=(3,)), cross(3),
             cross(1, peers=(2,)), cross(2, peers=(1,))]  # fmt: skip
    out = send_early(steps, Cross, _writes)
    # slot 1 goes to peer 2 alone: right after f0; slot 2 to peer 1: after the send of slot 3
    assert names(out) == ["f0", "cross 1", "g", "cross 3", "cross 2"]


def test_receives_and_routes_this_process_also_receives_stay_in_place():
    both = cross(1)
    both.route.receives = True
    steps = [launch("f0", results=(1,)), launch("f1", results=(2,)), both]
    assert send_early(steps, Cross, _writes) == steps


def test_a_send_gathering_over_processes_stays_in_place_on_every_process_of_its_source():
    # a value gathered on a 4-device source spanning processes 0 and 1 before it goes to a task
    # on process 2 whose 2 devices both get their copy from process 0: process 1 takes part in the
    # gather (a program with collectives between the two) but sends nothing. Moved up, the gather
    # went before the collective program "g" on process 1 (no peer to stay behind) and after it on
    # process 0 (behind its send of slot 2 to process 2): each waited in the other program.
    def rank(peers):
        steps = [launch("f", results=(1,)), launch("g", results=(2,)), cross(2, peers=(2,)),
                 cross(1, peers=peers, gathers=True)]  # fmt: skip
        return names(send_early(steps, Cross, _writes))

    assert rank((2,)) == rank(()) == ["f", "g", "cross 2", "cross 1"]
