"""Text that is safe to show on a terminal: names from files and peers, error messages.

Host names, device ids, NIC names and paths come from files and from other nodes; a name
holding ``ESC [2J`` clears the user's screen, an OSC sequence retitles the terminal, a
C1 ``CSI`` (U+009B) does the same on terminals that honour 8-bit controls, and a
right-to-left override reorders what follows. :func:`printable` is the one place such
characters are made visible: every renderer in :mod:`topomesh.report` passes names through
it, and so does the CLI's ``topomesh: error:`` line.
"""

from __future__ import annotations

import re
from types import MappingProxyType

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
"""C0 controls (newline and tab included), DEL, C1 controls, the Unicode line and paragraph
separators, and the bidirectional embedding/override/isolate controls."""


_NAMED = MappingProxyType({"\n": "\\n", "\t": "\\t", "\r": "\\r"})


def _escape(match: re.Match[str]) -> str:
    c = match.group()
    if c in _NAMED:
        return _NAMED[c]
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def printable(text: object) -> str:
    """``str(text)`` with every control character written as a visible escape (``\\x1b``,
    ``\\x9b``, ``\\u202e``), so what is printed is one line of plain characters.

    >>> printable("node\\x1b[2J-\\x9b31m")
    'node\\\\x1b[2J-\\\\x9b31m'
    >>> printable("GPU0"), printable("a\\nb")
    ('GPU0', 'a\\\\nb')
    """
    s = str(text)
    return _UNSAFE.sub(_escape, s) if _UNSAFE.search(s) else s
