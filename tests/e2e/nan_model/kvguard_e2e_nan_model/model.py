"""Models that poison their own hidden states with NaN, on a schedule their prompts carry.

:class:`NanFaults` injects the faults into any vLLM causal LM whose ``forward`` takes
``(input_ids, positions, intermediate_tensors, inputs_embeds)`` and that has
``embed_input_ids``; the models here are vLLM's own with it mixed in:

* :class:`NanLlamaForCausalLM` (attention only);
* :class:`NanQwen3NextForCausalLM` (hybrid: gated-delta-net and attention layers);
* :class:`NanGraniteMoeHybridForCausalLM` (hybrid: Mamba2 and attention layers).

In a hybrid model the NaN row also poisons the recurrent state of every linear-attention
(GDN / Mamba2) layer from that position on: the state the step leaves behind, and every
prefix-cache checkpoint of it taken after the fault, is NaN.

Faults are armed by *trigger tokens*: token ``TRIGGER + d`` (``0 <= d < SPAN``) at
position ``p`` of a prompt arms one fault at position ``p + d``. The row that computes
that position gets NaN embeddings: its K and V in every layer are NaN, and so are the
logits of that row and of every later token of its request (they attend to it). Each
armed fault fires once; a trigger seen again at the same position (a retry recomputing
it, another request sharing the prefix) does not re-arm it -- the fault is transient,
like the hardware faults it stands for. So:

* ``d = 0``: the fault fires on the trigger's own row, in the prefill step that
  computes it (with chunked prefill: the chunk that holds it);
* ``d`` past the prompt's end: it fires in the decode step that computes position
  ``p + d`` (with speculative decoding: the verification step whose rows reach it).

For ``d > 0`` the model does not know which request a later row belongs to: the fault
fires on the first row at position ``p + d`` after the trigger, in whatever request.
The tests keep other running requests away from armed positions.

A second kind of fault, armed by the test through the worker (``arm_crash``): the step
computing an armed position writes finite garbage into that row's KV (huge embeddings:
its K and V in every layer are wrong but finite) and then raises
:class:`InjectedFault` -- a worker failing mid-step after writing corrupt KV, the fault
engine fault tolerance recovers from. Each armed crash fires once.

A third kind, armed the same way (``arm_late_nan``): after the forward computing an
armed position, NaN lands in the KV cache block holding that position, in every layer
-- after attention read it, so the step's logits stay finite (a fault only an audit of
the KV itself sees). Each fires once.

State lives on the model instance: every engine (stock or guarded, in one process or
several) starts fault-free. ``fired`` records ``(position, trigger)`` of every fault
that fired, for tests that ask the worker (``collective_rpc``/``apply_model``).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM

TRIGGER = 900
"""The first trigger token id (the model's vocabulary must reach TRIGGER + SPAN)."""
SPAN = 100
"""Trigger ids: TRIGGER .. TRIGGER + SPAN - 1; trigger TRIGGER + d fires d tokens on."""


class InjectedFault(RuntimeError):
    """The crash a test armed (``crash_at``): the step wrote garbage KV, then failed."""


class NanFaults:
    """Trigger-token NaN faults (and armed crashes, late NaN) for the vLLM model class
    it is mixed into, listed first: ``class NanX(NanFaults, X)`` (see the module doc).

    The late-NaN fault writes into attention layers' KV caches only (a Mamba / GDN
    layer's cache is not one tensor)."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        # (vLLM reads this signature: keyword-only vllm_config and prefix.)
        super().__init__(vllm_config=vllm_config, prefix=prefix)  # type: ignore[call-arg]
        from vllm.distributed import get_pp_group

        self.first_stage = get_pp_group().is_first_rank
        """Whether this worker embeds the tokens: faults are injected there (a later
        pipeline stage has no embedding layer; the NaN reaches it through the hidden
        states the first stage sends)."""
        self.armed: set[int] = set()
        """Positions where an armed fault fires next."""
        self.seen: set[tuple[int, int]] = set()
        """(trigger position, trigger token) pairs that armed a fault."""
        self.fired: list[tuple[int, int]] = []
        """(position, trigger token) of every fault fired, in order."""
        self.fired_in: list[tuple[int, ...]] = []
        """The positions of the forward pass each fault fired in (e.g. a speculative
        decoding verification step: the request's 1 + drafts rows)."""
        self._origin: dict[int, int] = {}
        self.faults_enabled = True
        """False: trigger tokens are plain tokens (an engine giving fault-free
        reference outputs; set with ``LLM.apply_model``)."""
        self.crash_at: set[int] = set()
        """Positions whose step writes garbage KV for them and then raises (once)."""
        self.crashed: list[int] = []
        """The positions crashes fired at, in order."""
        self.late_nan_at: set[int] = set()
        """Positions whose KV block gets NaN after the forward computing them (once)."""
        self.late_nan_blocks: list[int] = []
        """The KV cache blocks late NaN was written into, in order."""

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        crash: list[int] = []
        if (
            self.faults_enabled
            and self.first_stage
            and input_ids is not None
            and inputs_embeds is None
        ):
            poison = self._rows_to_poison(input_ids, positions)
            if self.crash_at:
                crash = [i for i, p in enumerate(positions.tolist()) if p in self.crash_at]
            if poison or crash:
                inputs_embeds = self.embed_input_ids(input_ids)  # type: ignore[attr-defined]
                inputs_embeds[poison] = float("nan")
                inputs_embeds[crash] = 1e4  # finite garbage: wrong K and V, no NaN
                input_ids = None
        out = super().forward(  # type: ignore[misc]
            input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs
        )
        if self.faults_enabled and self.late_nan_at:
            late = [i for i, p in enumerate(positions.tolist()) if p in self.late_nan_at]
            if late:
                self._write_nan_into_kv(late)
                self.late_nan_at.difference_update(int(positions[i]) for i in late)
        if crash:
            fired = [int(positions[i]) for i in crash]
            self.crash_at.difference_update(fired)
            self.crashed += fired
            raise InjectedFault(f"injected fault: the step computing position(s) {fired} failed")
        return out

    def compute_logits(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # Trigger tokens are never sampled: a generated trigger would arm a fault no
        # test asked for. (-inf, not NaN: NaN counts see only the injected faults.)
        logits = super().compute_logits(hidden_states, *args, **kwargs)  # type: ignore[misc]
        if logits is not None:
            logits[..., TRIGGER : TRIGGER + SPAN] = float("-inf")
        return logits

    def _write_nan_into_kv(self, rows: list[int]) -> None:
        """NaN into the whole KV cache block each row's token is in, every layer (vLLM's
        CPU caches: ``[num_blocks, kv_heads, block_size, 2 * head_size]``)."""
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        blocks: list[int] = []
        for name, layer in context.no_compile_layers.items():
            cache = getattr(layer, "kv_cache", None)
            metadata = context.attn_metadata
            if not isinstance(cache, torch.Tensor) or not isinstance(metadata, dict):
                continue
            if name not in metadata:
                continue
            block_size = cache.shape[2]
            slots = metadata[name].slot_mapping
            blocks = sorted({int(slots[i]) // block_size for i in rows})
            cache[blocks] = float("nan")
        self.late_nan_blocks += blocks

    def _rows_to_poison(self, input_ids: torch.Tensor, positions: torch.Tensor) -> list[int]:
        ids = input_ids.tolist()
        pos = positions.tolist()
        n = len(ids)
        out = []
        armed = self.armed
        for i in range(n):
            token = ids[i]
            if TRIGGER <= token < TRIGGER + SPAN and (pos[i], token) not in self.seen:
                # Arm a fault d tokens on; d == 0 fires on this very row (below).
                self.seen.add((pos[i], token))
                target = pos[i] + token - TRIGGER
                armed.add(target)
                self._origin[target] = token
            if armed and pos[i] in armed:
                armed.discard(pos[i])
                self.fired.append((pos[i], self._origin.pop(pos[i])))
                self.fired_in.append(tuple(pos))
                out.append(i)
        return out


class NanLlamaForCausalLM(NanFaults, LlamaForCausalLM):
    """``LlamaForCausalLM`` with trigger-token NaN faults (see the module doc)."""


class NanQwen3NextForCausalLM(NanFaults, Qwen3NextForCausalLM):
    """``Qwen3NextForCausalLM`` (gated-delta-net + attention hybrid) with trigger-token
    NaN faults. vLLM treats it as hybrid (``IsHybrid``) like the class it extends."""


class NanGraniteMoeHybridForCausalLM(NanFaults, GraniteMoeHybridForCausalLM):
    """``GraniteMoeHybridForCausalLM`` (Mamba2 + attention hybrid) with trigger-token
    NaN faults. vLLM treats it as hybrid (``IsHybrid``) like the class it extends."""
