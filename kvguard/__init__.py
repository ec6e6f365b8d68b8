"""kvguard: a KV-cache block pool that shares or offloads KV only after it was validated.

``import kvguard`` imports neither torch, triton nor vllm: the pool core is pure Python.
Kernels live in :mod:`kvguard.kernels` (torch/triton), the vLLM adapter in
:mod:`kvguard.adapters.vllm`; both are imported only when asked for.
"""

from kvguard.block import BlockInfo
from kvguard.errors import (
    CorruptionError,
    DoubleFreeError,
    DuplicateRequestError,
    ForeignBlockError,
    IllegalTransitionError,
    InvariantViolation,
    KvGuardError,
    NoPendingStepError,
    NotAllocatedError,
    NotStorableError,
    OutOfBlocksError,
    PoolMisuseError,
    RequestAbortedError,
    RollbackError,
    StaleHitError,
    UnknownBlockError,
    UnknownRequestError,
    UnknownTicketError,
)
from kvguard.events import AllBlocksCleared, BlockRemoved, BlockStored, PoolEvent, RequestAborted
from kvguard.hashing import BlockHash, BlockHasher, default_block_hasher, hash_block_tokens
from kvguard.invariants import PoolSnapshot
from kvguard.pool import BlockPool
from kvguard.results import (
    BlockValidation,
    InvalidationReport,
    PrefixHit,
    PublishOutcome,
    RequestProgress,
    SlotRange,
    StepOutcome,
    StepResult,
    StoreTicket,
    TailRollback,
    TokenRange,
)
from kvguard.states import TRANSITIONS, BlockEvent, BlockState
from kvguard.stats import Counters, PoolStats
from kvguard.zeroing import ZeroPolicy

__version__ = "0.1.0"

__all__ = [
    "TRANSITIONS",
    "AllBlocksCleared",
    "BlockEvent",
    "BlockHash",
    "BlockHasher",
    "BlockInfo",
    "BlockPool",
    "BlockRemoved",
    "BlockState",
    "BlockStored",
    "BlockValidation",
    "CorruptionError",
    "Counters",
    "DoubleFreeError",
    "DuplicateRequestError",
    "ForeignBlockError",
    "IllegalTransitionError",
    "InvalidationReport",
    "InvariantViolation",
    "KvGuardError",
    "NoPendingStepError",
    "NotAllocatedError",
    "NotStorableError",
    "OutOfBlocksError",
    "PoolEvent",
    "PoolMisuseError",
    "PoolSnapshot",
    "PoolStats",
    "PrefixHit",
    "PublishOutcome",
    "RequestAborted",
    "RequestAbortedError",
    "RequestProgress",
    "RollbackError",
    "SlotRange",
    "StaleHitError",
    "StepOutcome",
    "StepResult",
    "StoreTicket",
    "TailRollback",
    "TokenRange",
    "UnknownBlockError",
    "UnknownRequestError",
    "UnknownTicketError",
    "ZeroPolicy",
    "__version__",
    "default_block_hasher",
    "hash_block_tokens",
]
