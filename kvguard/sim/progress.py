"""The progress bar of ``kvguard simulate``: one tick per run (ground truth, then each
policy at each fault rate), with the current run and step count beside it."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any

from kvguard.sim.config import Scenario


class Progress:
    def __init__(self, scenario: Scenario, num_policies: int, *, enabled: bool = True) -> None:
        rates = {scenario.fault_rate, *scenario.sweep}
        self.total = 1 + num_policies * len(rates)
        self.enabled = enabled
        self._bar: Any = None
        self._steps = 0
        self._label = ""

    def __enter__(self) -> Progress:
        if self.enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # the bar is a nicety: fall back to one line per run
                self._bar = None
            else:
                self._bar = tqdm(total=self.total, unit="run", file=sys.stderr, leave=False)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.close()

    @property
    def current(self) -> str:
        """The run going on now ("setup" before the first)."""
        return self._label or "setup"

    def run(self, label: str) -> None:
        """A new run starts (the previous one, if any, is done)."""
        if self._label and self._bar is not None:
            self._bar.update(1)
        self._label = label
        self._steps = 0
        if self._bar is not None:
            self._bar.set_description(label)
        elif self.enabled:
            print(f"running {label} ...", file=sys.stderr)

    def step(self) -> None:
        self._steps += 1
        if self._bar is not None and self._steps % 25 == 0:
            self._bar.set_postfix(step=self._steps, refresh=False)
