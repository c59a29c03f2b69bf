"""Checking that every process planned the same thing before any of them runs it."""

from __future__ import annotations

import itertools
import zlib

import jax

from mmnnx._jax import runtime
from mmnnx.distributed.exits import wait_for
from mmnnx.errors import MPMDError

_KEY = "mmnnx/agree/{}/{}"
_WAIT_S = 300.0
_round = itertools.count()


def check_same_everywhere(what: str, lines: list[str]) -> int:
    """Raises :class:`MPMDError` on every process if the processes' ``lines`` differ, naming the
    first difference (a collective, as every function here); the round's number."""
    me, count = jax.process_index(), jax.process_count()
    n = next(_round)
    runtime.key_value_set(_KEY.format(n, me), zlib.compress("\n".join(lines).encode()))
    for peer in range(count):
        if peer == me:
            continue
        try:
            raw = wait_for(_KEY.format(n, peer), peer, _WAIT_S, what)
        except TimeoutError as e:
            raise MPMDError(
                f"{what}: process {peer} did not plan it within {_WAIT_S:.0f} s (it runs other "
                "steps, or failed); every process must make the same mm.jit calls in the same "
                "order"
            ) from e
        theirs = zlib.decompress(raw).decode().split("\n")
        if theirs != lines:
            i = next(
                (i for i, (a, b) in enumerate(zip(lines, theirs, strict=False)) if a != b),
                min(len(lines), len(theirs)),
            )
            mine_line = lines[i] if i < len(lines) else "(nothing)"
            their_line = theirs[i] if i < len(theirs) else "(nothing)"
            low, high = sorted((me, peer))
            first, second = (mine_line, their_line) if me == low else (their_line, mine_line)
            raise MPMDError(
                f"{what} differs between processes {low} and {high} (every process must build "
                f"the same model and call the same steps with the same shapes); first "
                f"difference, line {i + 1}:\n  process {low}: {first}\n  process {high}: {second}"
            )
    return n


def from_process_zero(what: str, value: str) -> str:
    """Process 0's ``value`` on every process (a choice made of timings, once for the run)."""
    if jax.process_count() == 1:
        return value
    n = next(_round)
    key = _KEY.format(n, "chosen")
    if jax.process_index() == 0:
        runtime.key_value_set(key, value.encode())
        return value
    try:
        return wait_for(key, 0, _WAIT_S, what).decode()
    except TimeoutError as e:
        raise MPMDError(
            f"{what}: process 0 did not publish its choice within {_WAIT_S:.0f} s"
        ) from e
