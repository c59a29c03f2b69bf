"""What ``mmnnx launch`` leaves out of its processes' output unless ``--verbose``.

With ``--collectives gloo``, every gloo context prints ``[Gloo] Rank 0 is connected to 1 peer
ranks. Expected number of connected peer ranks is : 1`` to ``std::cout`` unconditionally
(``gloo/transport/tcp/context.cc``), so only the launcher can drop it; contexts connecting in
several threads interleave their pieces, and a line of such pieces only is chatter too (its
last piece may be a message's middle, " peer ranks. ", whose space the line's end drops).
``--verbose`` also sets ``TF_CPP_MIN_LOG_LEVEL=0`` (JAX's C++ information logs).
"""

from __future__ import annotations

import re

_PIECE = (
    r"\[Gloo\] Rank |\d+| is connected to | peer ranks\. ?"
    r"|Expected number of connected peer ranks is : "
)
_GLOO_CONNECTED = re.compile(rf"(?:{_PIECE})+")
_WORDS = re.compile(r"\[Gloo\] Rank | is connected to |Expected number of connected")


def is_chatter(line: str) -> bool:
    """Whether ``line`` (without its newline) is gloo's "connected" message, or pieces of several
    printed in between each other."""
    text = line.rstrip()
    return bool(_GLOO_CONNECTED.fullmatch(text)) and bool(_WORDS.search(text))
