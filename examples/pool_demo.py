"""A two-minute tour of kvguard's pool: the race it closes, an abort, a recovery.

Run: python examples/pool_demo.py
"""

from __future__ import annotations

from kvguard import BlockPool, BlockState


def show(pool: BlockPool, rid: str) -> str:
    return " ".join(pool.block_info(b).state.name for b in pool.block_table(rid))


def main() -> None:
    pool = BlockPool(num_blocks=64, block_size=16, check_invariants=True)
    system_prompt = list(range(1000, 1064))  # 4 blocks shared by every request

    print("step 1: request A's prompt is scheduled (its KV is being written)")
    prompt_a = system_prompt + [1, 2, 3]
    pool.add_request("A", prompt_a)
    # A lookup keeps the last prompt token out of the hit, as vLLM does: a step computes
    # at least one token, whose logits give the next token.
    hit = pool.lookup("A", max_tokens=len(prompt_a) - 1)
    pool.allocate("A", len(prompt_a), hit=hit)  # the request's total token count
    pool.write("A", len(prompt_a) - hit.num_tokens)
    print("   A:", show(pool, "A"))

    print("step 2: B arrives with the same system prompt before A's output is checked")
    prompt_b = system_prompt + [4, 5]
    pool.add_request("B", prompt_b)
    hit = pool.lookup("B", max_tokens=len(prompt_b) - 1)
    print("   B's prefix hit:", hit.num_tokens, "tokens (vLLM 0.32-0.34 would hit 64)")

    print("step 2: A's logits were clean -> its full blocks are published")
    pool.validate_step("A")
    print("   A:", show(pool, "A"))
    hit = pool.lookup("B", max_tokens=len(prompt_b) - 1)
    pool.allocate("B", len(prompt_b), hit=hit)
    pool.write("B", len(prompt_b) - hit.num_tokens)
    print("   B now hits", hit.num_tokens, "tokens")

    print("step 3: B's logits contain NaN -> B alone is aborted")
    result = pool.fail_step("B")
    print("   B:", show(pool, "B"), "| quarantined:", result.quarantined)
    print("   A is untouched:", show(pool, "A"))

    print("recovery: roll B back to its validated boundary instead of recomputing")
    rollback = pool.zero_request_tail("B")
    print(f"   B resumes at token {rollback.num_tokens}; wipe slots {list(rollback.slots)}")
    pool.write("B", 2)
    pool.validate_step("B")
    print("   B:", show(pool, "B"))

    pool.free("A")
    pool.free("B")
    stats = pool.stats()
    quarantined = stats.blocks_by_state[BlockState.QUARANTINED]
    print(
        f"done: {stats.counters.requests_aborted} abort, "
        f"{stats.counters.deferred_publications} publications deferred until validation, "
        f"{quarantined} blocks quarantined, {stats.counters.slots_zeroed} slots wiped, "
        f"prefix hit rate {stats.prefix_hit_rate:.0%}"
    )


if __name__ == "__main__":
    main()
