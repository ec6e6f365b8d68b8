"""Invalidation: KV found corrupt after the fact leaves the prefix cache, every tier
and every load in flight."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import hash_block_tokens
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from kvguard.adapters.vllm.exits.gate import group_key, group_keys
from kvguard.adapters.vllm.exits.tier_purge import TierPurgeReport
from kvguard.adapters.vllm.scheduler.startup import _GuardStartUp, logger
from kvguard.hashing import BlockHash


class _Invalidation(_GuardStartUp):
    """``kvguard_invalidate`` and the loads it poisons."""

    def kvguard_invalidate(
        self, block_hashes: Iterable[bytes], *, descendants: bool = True
    ) -> TierPurgeReport:
        """KV found corrupt after the fact: taint vLLM's block hashes (as in
        ``Request.block_hashes``) in every KV cache group. Blocks holding them leave
        the prefix cache and are quarantined, the requests holding them are aborted
        (kvguard's record; vLLM's requests run on unless the caller finishes them),
        and every tier copy of them is purged from the tier that holds it (the
        guarded connectors' CPU tiers and stores). With ``descendants``, the hashes
        chained after them too: their KV was computed attending to the corrupt KV."""
        groups = len(self.kv_cache_config.kv_cache_groups)
        keys = group_keys(block_hashes, groups)
        report = self.kvguard_pool.invalidate(keys, descendants=descendants)
        self._kvguard_poison_loads(set(report.invalidation.hashes))
        self.kvguard_metrics.tier_copies_purged += report.copies_purged
        logger.warning(
            "kvguard: invalidated %d block hash(es): %d block(s) quarantined, %d tier "
            "cop(ies) purged (%s)",
            len(report.invalidation.hashes),
            len(report.invalidation.block_ids),
            report.copies_purged,
            ", ".join(f"{tier}: {len(h)}" for tier, h in sorted(report.purged.items()))
            or "no tier held one",
        )
        return report

    def _kvguard_poison_loads(self, tainted: set[BlockHash]) -> None:
        """Requests loading KV of a ``tainted`` hash (waiting for a connector's load),
        or holding such loaded KV no step vouched for yet: the invalidation cannot
        reach it (its blocks carry no hash until a step validates them), so the next
        output reports it to vLLM as a failed load, which vLLM recomputes or fails
        (``kv_load_failure_policy``)."""
        waiting, blocks = self._kvguard_poisoned_loads
        carried = self._kvguard_ledger.carried.fills
        hash_block_size = self.kvguard_pool.hash_block_size
        managers = self.kv_cache_manager.coordinator.single_type_managers
        for req_id, request in self.requests.items():
            loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if not loading and req_id not in carried:
                continue
            hit = []
            for group_id, manager in enumerate(managers):
                if manager.block_size != hash_block_size:
                    continue  # (no connector loads such a group's blocks by hash)
                for block, block_hash in zip(
                    manager.req_to_blocks.get(req_id, ()), request.block_hashes, strict=False
                ):
                    if not block.is_null and group_key(block_hash, group_id) in tainted:
                        hit.append(block.block_id)
            if not hit:
                continue
            if loading:
                waiting.add(req_id)
            elif len(managers) == 1:  # (vLLM maps block ids to requests in one group only)
                blocks.update(hit)
            else:
                logger.warning(
                    "kvguard: request %s holds loaded KV invalidated before a step vouched "
                    "for it; on a model with several KV cache groups vLLM cannot be told "
                    "which blocks failed, so it is not recomputed",
                    req_id,
                )

    def _kvguard_report_poisoned_loads(self, model_runner_output: Any) -> None:
        """Add the loads :meth:`_kvguard_poison_loads` found to this output's failed
        loads, as the workers would report them."""
        waiting, blocks = self._kvguard_poisoned_loads
        self._kvguard_poisoned_loads = (set(), set())
        output = model_runner_output.kv_connector_output
        if output is None:
            output = model_runner_output.kv_connector_output = KVConnectorOutput()
        output.failed_recving = set(output.failed_recving or ()) | waiting
        output.invalid_block_ids = set(output.invalid_block_ids or ()) | blocks

    def kvguard_invalidate_tokens(
        self, token_ids: Sequence[int], *, descendants: bool = True
    ) -> TierPurgeReport:
        """:meth:`kvguard_invalidate` for the full blocks of a token prefix (a plain
        text prompt: no multimodal inputs, LoRA or cache salt in its hashes), hashed
        as vLLM hashes a prompt's blocks."""
        block_size = self.kvguard_pool.hash_block_size
        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        hashes: list[bytes] = []
        parent = None
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            parent = hash_block_tokens(hash_fn, parent, token_ids[start : start + block_size])
            hashes.append(parent)
        return self.kvguard_invalidate(hashes, descendants=descendants)
