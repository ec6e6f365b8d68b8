"""docs/vllm.md's table of counters names every counter ``/metrics`` serves, once, and
no other. (No vLLM needed: the names are kvguard's.)"""

from __future__ import annotations

import re
from pathlib import Path

from kvguard.adapters.vllm import metrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"


def _table_counters() -> list[str]:
    text = DOC.read_text()
    start = text.index("### Counters on `/metrics`")
    section = text[start : text.index("\n## ", start)]
    return re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE)


def test_the_counter_table_lists_every_served_counter_once() -> None:
    listed = _table_counters()
    assert len(listed) == len(set(listed)), listed
    served = set(metrics._FRONT_END_HELP)
    assert set(metrics.GuardMetrics.__slots__) | set(metrics.SERVED_CONNECTOR_HELP) <= served
    assert set(listed) == served, (
        f"missing from docs/vllm.md: {sorted(served - set(listed))}; "
        f"not a counter: {sorted(set(listed) - served)}"
    )
