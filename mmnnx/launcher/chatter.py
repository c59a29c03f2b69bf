"""What ``mmnnx launch`` leaves out of its processes' output unless ``--verbose``.

With collectives between processes on CPU (``--collectives gloo``), every gloo context JAX's
CPU client makes (one per set of devices a collective runs over, in every process) prints a
line when it has connected, ``[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of
connected peer ranks is : 1``: gloo writes it to ``std::cout`` unconditionally
(``gloo/transport/tcp/context.cc``, ``printConnectivityInfo``), so no log level silences it;
only the launcher, which reads every line its processes print, can. Contexts connecting at the
same time in several threads of a process write their pieces in between each other's, so a
line can hold several pieces, or start in the middle of a message: a line made only of pieces
of that message is chatter too. Anything else (``is NOT connected to``, errors, the program's
own output) is kept.

JAX's own C++ log lines are governed by ``TF_CPP_MIN_LOG_LEVEL``, which JAX sets to 1
(warnings and errors) unless it is set; ``mmnnx launch --verbose`` sets it to 0 (information
too: the coordination service's connections, barriers, shutdown).
"""

from __future__ import annotations

import re

_PIECE = (
    r"\[Gloo\] Rank |\d+| is connected to | peer ranks\. "
    r"|Expected number of connected peer ranks is : "
)
_GLOO_CONNECTED = re.compile(rf"(?:{_PIECE})+")
_WORDS = re.compile(r"\[Gloo\] Rank | is connected to |Expected number of connected")


def is_chatter(line: str) -> bool:
    """Whether ``line`` (without its newline) is gloo's "connected" message, or pieces of
    several printed in between each other.

    Example:
        >>> is_chatter("[Gloo] Rank 1 is connected to 1 peer ranks. "
        ...            "Expected number of connected peer ranks is : 1")
        True
        >>> is_chatter("[Gloo] Rank 0 is NOT connected to: [1]"), is_chatter("42")
        (False, False)
    """
    text = line.rstrip()
    return bool(_GLOO_CONNECTED.fullmatch(text)) and bool(_WORDS.search(text))
