"""Regenerate the state diagram in docs/states.md from the transition table.

Usage: ``python -m kvguard.statedoc docs/states.md`` (prints the diagram without a path).
"""

from __future__ import annotations

import re
import sys

from kvguard.states import mermaid_diagram


def rewrite(path: str) -> None:
    """Replace the first mermaid block of ``path`` with the current diagram."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    block = "```mermaid\n" + mermaid_diagram() + "\n```"
    new, n = re.subn(r"```mermaid\n.*?```", lambda _: block, text, count=1, flags=re.S)
    if n != 1:
        raise SystemExit(f"{path} has no ```mermaid block to replace")
    with open(path, "w", encoding="utf-8") as f:
        f.write(new)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        rewrite(sys.argv[1])
    else:
        print(mermaid_diagram())
