"""Text safe to echo to a terminal: model output and prompts with their control characters escaped."""

from __future__ import annotations

import unicodedata


def printable(text: str) -> str:
    """`text` with control characters escaped, safe to echo to a terminal.

    C0 controls other than newline and tab, DEL and C1 controls are written as Python
    escapes ("\\x1b", "\\r"), so model output or a prompt cannot move the cursor,
    rewrite a line, change colours or start an escape sequence. Other text is unchanged.
    """
    return text.translate(_CONTROL_ESCAPES)


# Every Unicode "Cc" character (C0, DEL, C1) except "\t" and "\n", mapped to its repr() escape.
_CONTROL_ESCAPES = {cp: repr(chr(cp))[1:-1] for cp in range(0xA0)
                    if unicodedata.category(chr(cp)) == "Cc" and chr(cp) not in "\t\n"}
