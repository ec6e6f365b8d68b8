"""Window frees: blocks vLLM frees from a running request's sliding window, local
chunk or R-SWA gap are validated as they are released when every step that wrote them
passed, else quarantined."""

from __future__ import annotations

from kvguard.adapters.vllm.scheduler.startup import _GuardStartUp, logger
from kvguard.errors import EngineContractError


class _WindowFrees(_GuardStartUp):
    """How a window's frees are released."""

    def _kvguard_name_window_frees(self) -> None:
        """Sliding-window, chunked-local and R-SWA groups free blocks of a running
        request: those that left its window or local chunk, or R-SWA's gap between its
        prompt and its window (vLLM's ``remove_skipped_blocks``). Their managers free
        them with ``block_pool.free_blocks(blocks)``: neither the request nor how the
        release should go reaches the pool. The coordinator's ``remove_skipped_blocks``
        -- the one entry of every window free, from ``allocate_slots`` and from
        ``_connector_finished`` -- is the one place that knows the request: wrapped, it
        names it for the pool's question (:meth:`_kvguard_window_frees`), asked about
        the blocks vLLM actually frees (most calls free none)."""
        coordinator = self.kv_cache_manager.coordinator
        remove_skipped = coordinator.remove_skipped_blocks

        def remove_skipped_blocks(
            request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
        ) -> None:
            self._kvguard_window = request_id
            try:
                remove_skipped(request_id, processed_computed_tokens, num_prompt_tokens)
            finally:
                self._kvguard_window = None

        coordinator.remove_skipped_blocks = remove_skipped_blocks

    def _kvguard_window_frees(self, block_ids: list[int]) -> bool | None:
        """The pool's question on every release: while vLLM frees a request's window,
        whether every step that wrote these blocks passed; otherwise None (the release
        goes as its caller said). What vLLM cached is taken from the pool's outbox first,
        so that a block vouched for -- a fill that settled, a copy of a clean state --
        is validated before it is released, and the window's fills are in the ledger."""
        self._kvguard_take_cached()
        window = self._kvguard_window
        return None if window is None else self._kvguard_window_free(window, block_ids)

    def _kvguard_window_free(self, request_id: str, block_ids: list[int]) -> bool:
        """vLLM frees these blocks of a running request's window (before releasing
        them): whether every step that wrote them passed.

        vLLM frees only blocks below the request's *processed* tokens, so every step
        that wrote them has reported: they are validated as they are released -- not
        quarantined and zeroed -- unless the request's last reported step is not known
        clean, or it holds connector-loaded KV no step vouched for yet.

        Under async scheduling the step that *cached* a block (the one after the step
        that completed it, once its last token was known) may still be in flight when
        a local chunk's end frees it. When the request is clean such blocks are
        validated and published now, not at that step's output (by then the block
        may be someone else's); either way they leave that step's record. A block
        whose cached tokens reach past what kvguard's ledger counts as reported is
        one a step in flight may still write: vLLM's contract is broken, and the
        blocks are quarantined (under ``check_invariants``: :class:`~kvguard.errors.
        EngineContractError`).
        """
        ledger = self._kvguard_ledger
        carried = ledger.carried.fills.get(request_id)
        clean = not carried and self._kvguard_reported_clean(request_id)
        in_flight = ledger.filled_in_flight(request_id, block_ids)
        if in_flight:
            pool = self.kvguard_pool
            reported = self._kvguard_reported_tokens(request_id)
            blocks = pool.blocks
            unreported = sorted(b for b in in_flight if blocks[b].num_hash_tokens > reported)
            if unreported:
                message = f"the window freed blocks {unreported} that a step in flight fills"
                if clean and pool.guard.check_invariants:
                    raise EngineContractError(
                        f"kvguard: {message} (request {request_id!r}, {reported} tokens "
                        "reported): vLLM frees a window only below a request's processed "
                        "tokens"
                    )
                if not self.kvguard_metrics.window_contract_breaks:
                    logger.warning("kvguard: %s; they are quarantined", message)
                self.kvguard_metrics.window_contract_breaks += 1
                clean = False
            taken = ledger.take_fills(request_id, in_flight)
            if clean:
                pool.validate_fills(taken)
        if carried:
            # Loaded blocks the window drops (quarantined: not clean) are no longer the
            # request's to vouch for.
            ledger.carried.drop(request_id, set(block_ids))
        return clean

    def _kvguard_reported_clean(self, request_id: str) -> bool:
        """Whether every step of the request that reported back was counted clean."""
        request = self.requests.get(request_id)
        if request is not None and request.is_finished():
            # Settled on its way out (a connector's request_finished frees its window
            # first): clean only with no step in flight -- the safe side.
            return request_id in self._kvguard_clean
        return request_id not in self._kvguard_unchecked and request_id not in self._kvguard_failing
