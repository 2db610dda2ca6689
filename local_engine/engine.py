"""`LLMEngine`: the scheduler, the block manager, the model runner and the sampler meet in one `step()`.

Single-threaded and synchronous; `AsyncEngine` drives it from its own thread for the gateway.

Failure isolation: an exception while handling ONE request (building it, sampling its rows, detokenizing, stop
strings, shaping its output) ends that request alone: its blocks are freed and `step()` returns a final output
carrying the `error`, while the other requests carry on. An exception anywhere else in `step()` (scheduling, the
model forward) propagates: the caller then `reset()`s the engine, which forgets every request.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import resource
import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from local_engine.block_manager import BlockManager
from local_engine.config import EngineConfig, ModelConfig
from local_engine.errors import DuplicateRequestError, InvalidParamError, PromptTooLongError
from local_engine.fair_share import DEFAULT_TENANCY, Tenancy
from local_engine.metrics import ThroughputMeter
from local_engine.model_runner import ModelRunner
from local_engine.output_processor import (
    CompletionOutput,
    Detokenizer,
    EngineStages,
    IncrementalDetokenizer,
    RequestOutput,
    accumulate,
)
from local_engine.sampler import Sampler
from local_engine.sampling_params import SamplingParams
from local_engine.scheduler import ScheduledBatch, Scheduler
from local_engine.sequence import FinishReason, Sequence
from local_engine.speculative import build_speculator, off_stats
from local_engine.step_tokens import StepTokens, sample, verify

if TYPE_CHECKING:
    from local_engine.loader import Checkpoint

__all__ = ["LLMEngine", "PromptTooLongError"]

logger = logging.getLogger("unigate.engine")


@dataclass
class _Request:
    request_id: str
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer | None]
    queued_ns: int = 0  # wall clock of its arrival in the engine (`EngineStages`)
    first_token_ns: int = 0

    @property
    def is_finished(self) -> bool:
        seqs = self.seqs
        return seqs[0].is_finished if len(seqs) == 1 else all(s.is_finished for s in seqs)

    def stages(self, finished_ns: int = 0) -> EngineStages:
        """When it reached each stage (the first sequence is admitted first: its siblings wait for its prompt)."""
        return EngineStages(self.queued_ns, self.seqs[0].scheduled_ns, self.first_token_ns, finished_ns)

    def final_output(self, outputs: list[CompletionOutput]) -> RequestOutput:
        """The request's last output, with its speculative decoding totals and its stages (finished now)."""
        first = self.seqs[0]
        return RequestOutput(
            self.request_id,
            outputs,
            first.num_prompt_tokens,
            first.num_cached_tokens,
            finished=True,
            num_spec_proposed=sum(s.num_spec_proposed for s in self.seqs),
            num_spec_accepted=sum(s.num_spec_accepted for s in self.seqs),
            stages=self.stages(time.time_ns()),
        )


class LLMEngine:
    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        state_dict: dict[str, torch.Tensor],
        *,
        tokenizer: Detokenizer | None = None,
        eos_token_ids: frozenset[int] | None = None,
        block_weights: Mapping[str, tuple[str, np.ndarray]] | None = None,
        cache_dir: Path | None = None,
    ) -> None:
        """`cache_dir`: where a GGUF draft model's conversion is cached (`speculative.draft_model_path`)."""
        self.model_config = model_config
        self.engine_config = engine_config
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids if eos_token_ids is not None else frozenset(model_config.eos_token_ids)
        self.runner = ModelRunner(model_config, engine_config, state_dict, block_weights)
        self.capacity = self.runner.capacity
        self.meter = ThroughputMeter()
        self.requests: dict[str, _Request] = {}
        self._generate_ids = itertools.count()
        self.block_manager, self.scheduler, self.sampler = self._build_scheduling()
        draft = None
        if engine_config.speculative.method == "draft":
            from local_engine.draft import DraftProposer

            draft = DraftProposer.build(
                engine_config, model_config, self.capacity, state_dict, block_weights, cache_dir=cache_dir
            )
        self.speculator = build_speculator(engine_config.speculative, draft)
        # what a pre-quantized checkpoint said it is (e.g. "gptq int4 g128"); None when the engine quantized it
        self.checkpoint_quantization: str | None = None
        # the sampling defaults the model comes with (`loader.model_sampling_defaults`); a deployment may replace them
        self.model_sampling_defaults: dict[str, float] = {}

    def _build_scheduling(self) -> tuple[BlockManager, Scheduler, Sampler]:
        config = self.engine_config
        block_manager = BlockManager(
            self.capacity.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        scheduler = Scheduler(
            block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.runner.max_model_len,
        )
        return block_manager, scheduler, Sampler()

    def reset(self) -> None:
        """Forget every request and rebuild the scheduling state (block manager, prefix cache, scheduler,
        sampler) after a failed step. The weights and the KV cache tensors stay; their contents are unreferenced."""
        self.requests.clear()
        self.block_manager, self.scheduler, self.sampler = self._build_scheduling()
        if self.speculator is not None:
            self.speculator.reset()

    @classmethod
    def from_checkpoint(
        cls, checkpoint: Checkpoint, engine_config: EngineConfig, *, cache_dir: Path | None = None
    ) -> LLMEngine:
        """From a loaded checkpoint (`local_engine.loader.load_checkpoint`)."""
        model_config = ModelConfig.from_hf_config(checkpoint.hf_config)
        declared = checkpoint.hf_config.get("unigate_quantization")
        if declared and engine_config.quantization == "none":  # a pre-quantized checkpoint (`prequantized.py`)
            engine_config = engine_config.model_copy(
                update={"quantization": declared["method"], "quantization_group_size": declared["group_size"]}
            )
        _warn_sliding_window(checkpoint.source, model_config, engine_config)
        tokenizer = checkpoint.tokenizer
        eos = frozenset(model_config.eos_token_ids) | tokenizer.eos_token_ids
        engine = cls(
            model_config,
            engine_config,
            checkpoint.state_dict,
            tokenizer=tokenizer,
            eos_token_ids=eos,
            block_weights=checkpoint.blocks,
            cache_dir=cache_dir,
        )
        engine.checkpoint_quantization = declared.get("checkpoint") if declared else None
        engine.model_sampling_defaults = dict(checkpoint.sampling_defaults)
        return engine

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + completion) this engine can ever run."""
        return self.scheduler.max_model_len

    # -- requests -----------------------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request can run at all; returns its resolved max_tokens. Raises InvalidParamError (naming the
        field) or PromptTooLongError. Thread-safe (reads only constants)."""
        if not isinstance(params, SamplingParams):
            raise InvalidParamError(f"sampling parameters must be SamplingParams, got {type(params).__name__}")
        params.validate()  # built valid, but never trust a value that reaches the step thread
        if not prompt_token_ids:
            raise InvalidParamError("the prompt is empty: send at least one token")
        vocab = self.model_config.vocab_size
        if not all(type(t) is int for t in prompt_token_ids) or min(prompt_token_ids) < 0:
            raise InvalidParamError(f"prompt token ids must be integers in [0, {vocab})")
        if max(prompt_token_ids) >= vocab:
            raise InvalidParamError(f"prompt token ids must be integers in [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise InvalidParamError("stop strings need a tokenizer", param="stop")
        if any(token_id >= vocab for token_id in params.stop_token_ids):
            raise InvalidParamError(f"stop_token_ids must be token ids in [0, {vocab})", param="stop_token_ids")
        if any(token_id >= vocab for token_id, _ in params.logit_bias):
            raise InvalidParamError(f"logit_bias keys must be token ids in [0, {vocab})", param="logit_bias")
        return self.scheduler.resolve_max_tokens(len(prompt_token_ids), params.max_tokens)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tenancy: Tenancy = DEFAULT_TENANCY,
        *,
        queued_ns: int = 0,
    ) -> None:
        """Queue a request; `tenancy` says whose share of the engine serves it (tenant, weight, priority).
        `queued_ns`: when it arrived in the engine (`time.time_ns()`; 0: now), e.g. before it waited for a step."""
        if request_id in self.requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already running")
        max_tokens = self.validate(prompt_token_ids, params)
        request = self._build_request(request_id, prompt_token_ids, params, max_tokens, tenancy)
        request.queued_ns = queued_ns or time.time_ns()
        self.requests[request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)

    def _build_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        tenancy: Tenancy,
    ) -> _Request:
        seqs: list[Sequence] = []
        for index in range(params.n):
            seqs.append(
                Sequence(
                    request_id,
                    prompt_token_ids,
                    params,
                    max_tokens=max_tokens,
                    eos_token_ids=self.eos_token_ids,
                    index=index,
                    parent=seqs[0] if seqs else None,
                    tenancy=tenancy,
                )
            )
        detokenizers: list[IncrementalDetokenizer | None] = [
            IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            if self.tokenizer is not None
            else None
            for _ in seqs
        ]
        return _Request(request_id, seqs, detokenizers)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (finish_reason "abort")."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        outputs = []
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)
                self._forget(seq)
                outputs.append(
                    CompletionOutput(seq.index, finish_reason="abort", num_output_tokens=seq.num_output_tokens)
                )
        final = request.final_output(outputs)
        final.num_cached_tokens = 0
        return final

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # -- the step -----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample (or verify the proposed tokens), and return the requests that
        progressed."""
        speculator = self.speculator
        if speculator is not None:
            speculator.propose(self.scheduler.running, self.scheduler.max_model_len)
        batch = self.scheduler.schedule()
        if speculator is not None:
            for seq in batch.preempted:
                speculator.forget(seq)
        if batch.is_empty:
            return []
        seqs = [s for s, is_sampling in zip(batch.seqs, batch.sampling_mask(), strict=True) if is_sampling]
        num_prompt = _num_prompt_tokens(batch)
        logits = self.runner.run(batch)
        if speculator is not None and any(s.spec_token_ids for s in seqs):
            new = verify(speculator, self.sampler, logits, seqs)
        else:
            new = sample(self.sampler, logits, seqs)
        num_before = [len(s.token_ids) for s in seqs]
        self.scheduler.postprocess(batch, new.token_ids, new.accepted_token_ids)
        if speculator is not None and new.accepted_token_ids is not None:
            speculator.record_step(seqs, new.num_proposed, new.accepted_token_ids)
        self.meter.record(num_prompt, sum(len(s.token_ids) - n for s, n in zip(seqs, num_before, strict=True)))
        return self._outputs(seqs, num_before, new)

    def _outputs(self, seqs: list[Sequence], num_before: list[int], new: StepTokens) -> list[RequestOutput]:
        """Each request's output of this step: its sequences' new tokens detokenized and checked for stop strings
        (`_process_tokens`), or the final output of a request that failed (`_fail_request`)."""
        failed = new.failed
        changed: dict[str, tuple[_Request, list[CompletionOutput]]] = {}
        for seq, before, logprobs in zip(seqs, num_before, new.logprobs, strict=True):
            if seq.request_id in failed:
                continue
            request = self.requests[seq.request_id]
            try:
                out = self._process_tokens(seq, request, before)
            except Exception as error:  # this request's own processing: fail it alone
                failed[seq.request_id] = error
                continue
            if logprobs[0] is not None:
                out.logprobs = [lp for lp in logprobs[: len(out.token_ids)] if lp is not None]
            _collect(changed, request, out)
        results = [self._fail_request(request_id, error) for request_id, error in failed.items()]
        for request_id, (request, outputs) in changed.items():
            if request_id in failed:
                continue
            is_first = not request.first_token_ns
            if is_first:
                request.first_token_ns = time.time_ns()
            if request.is_finished:
                del self.requests[request_id]
                results.append(request.final_output(outputs))
                continue
            first = request.seqs[0]
            output = RequestOutput(request_id, outputs, first.num_prompt_tokens, first.num_cached_tokens)
            if is_first:
                output.stages = request.stages()
            results.append(output)
        return results

    def _process_tokens(self, seq: Sequence, request: _Request, num_before: int) -> CompletionOutput:
        """`_process_token` for the tokens a verification appended (`seq.token_ids[num_before:]`): a stop string
        completed before the last of them ends the sequence there, and the tokens after it are dropped, as if
        they had never been generated."""
        new_token_ids = seq.token_ids[num_before:]
        if len(new_token_ids) == 1:
            return self._process_token(seq, request)
        detokenizer = request.detokenizers[seq.index]
        finished = seq.is_finished
        text = ""
        if detokenizer is not None:
            # EOS and stop token ids end the text without appearing in it.
            feed = new_token_ids[:-1] if finished and seq.finish_reason is FinishReason.STOP else new_token_ids
            for i, token_id in enumerate(feed):
                text += detokenizer.add_tokens([token_id])
                if detokenizer.stop_reason is None:
                    continue
                if i + 1 < len(new_token_ids) or not finished:
                    del seq.token_ids[num_before + i + 1 :]
                    new_token_ids = new_token_ids[: i + 1]
                    if finished:
                        seq.finish_reason = FinishReason.STOP
                    else:
                        self.scheduler.finish(seq, FinishReason.STOP)
                        finished = True
                    seq.stop_reason = detokenizer.stop_reason
                break
            if finished:
                text += detokenizer.flush()
        num_output_tokens = len(seq.token_ids) - seq.num_prompt_tokens
        if not finished:
            return CompletionOutput(seq.index, text, new_token_ids, num_output_tokens=num_output_tokens)
        self._forget(seq)
        reason = seq.finish_reason.value if seq.finish_reason is not None else None
        return CompletionOutput(seq.index, text, new_token_ids, None, reason, seq.stop_reason, num_output_tokens)

    def _forget(self, seq: Sequence) -> None:
        """`seq` is finished: drop its sampling generator and what the proposer holds for it."""
        self.sampler.forget(seq)
        if self.speculator is not None:
            self.speculator.forget(seq)

    def _fail_request(self, request_id: str, error: Exception) -> RequestOutput:
        """End one request whose processing raised: free its blocks and hand back a final output with `error`."""
        logger.error("request %s failed inside the engine; the others carry on", request_id, exc_info=error)
        final = self.abort_request(request_id)
        assert final is not None  # it was running in this step
        final.outputs = []
        final.error = error
        return final

    def _process_token(self, seq: Sequence, request: _Request) -> CompletionOutput:
        """Detokenize the new token, apply stop strings, and describe the change."""
        token_id = seq.token_ids[-1]
        detokenizer = request.detokenizers[seq.index]
        finished = seq.is_finished
        text = ""
        if detokenizer is not None:
            # EOS and stop token ids end the text without appearing in it.
            if not (finished and seq.finish_reason is FinishReason.STOP):
                text = detokenizer.add_tokens([token_id])
                if detokenizer.stop_reason is not None and not finished:
                    self.scheduler.finish(seq, FinishReason.STOP)
                    seq.stop_reason = detokenizer.stop_reason
                    finished = True
            if finished:
                text += detokenizer.flush()
        num_output_tokens = len(seq.token_ids) - seq.num_prompt_tokens
        if not finished:
            return CompletionOutput(seq.index, text, [token_id], num_output_tokens=num_output_tokens)
        self._forget(seq)
        reason = seq.finish_reason.value if seq.finish_reason is not None else None
        return CompletionOutput(seq.index, text, [token_id], None, reason, seq.stop_reason, num_output_tokens)

    # -- convenience and stats ----------------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[CompletionOutput]]:
        """Run prompts to completion (tests, benchmarks); returns the complete choices of each prompt."""
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        deltas: dict[str, list[RequestOutput]] = {}
        ids = [f"generate-{next(self._generate_ids)}" for _ in prompts]
        for request_id, prompt, p in zip(ids, prompts, all_params, strict=True):
            self.add_request(request_id, prompt, p)
            deltas[request_id] = []
        while self.has_unfinished_requests:
            for out in self.step():
                if out.error is not None:
                    raise out.error
                deltas.setdefault(out.request_id, []).append(out)
        return [accumulate(deltas[r], p.n) for r, p in zip(ids, all_params, strict=True)]

    def kv_utilization(self) -> float:
        """Tokens stored / token slots allocated over the blocks live sequences hold (shared blocks once)."""
        size = self.block_manager.block_size
        filled: dict[int, int] = {}
        for seq in self.scheduler.running:
            for i, block_id in enumerate(seq.block_table):
                used = min(size, max(0, seq.num_computed_tokens - i * size))
                filled[block_id] = max(filled.get(block_id, 0), used)
        return sum(filled.values()) / (len(filled) * size) if filled else 1.0

    def peak_memory_bytes(self) -> int:
        if self.runner.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.runner.device))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)  # ru_maxrss is KiB on Linux

    def stats(self) -> dict[str, Any]:
        scheduler = self.scheduler
        bm = self.block_manager
        prompt_rate, generation_rate = self.meter.rates()
        return {
            "model_type": self.model_config.model_type,
            "device": str(self.runner.device),
            "dtype": self.runner.dtype_name,
            "kv_cache_dtype": self.runner.kv_dtype_name,  # capacity: its bytes per token and what fits
            "quantization": self.engine_config.quantization,  # weight-only: none, int8 or int4 (at load time)
            # a pre-quantized checkpoint's own (GPTQ / AWQ / auto-round), e.g. "awq int4 g128"; else None
            "checkpoint_quantization": self.checkpoint_quantization,
            "attention_backend": self.runner.attention_backend,
            "ops": self.runner.ops_name,  # torch_ops, cpu_ops (native CPU kernels) or kernels (Triton)
            "fused_cpu_decode": self.runner.cpu_decoder is not None,  # decode steps in one native call (CPU)
            # GGUF block type -> projections whose decode panels keep the file's own blocks (CPU), e.g. {"Q4_1": 120}
            "gguf_block_panels": dict(self.runner.block_panels),
            "num_running_seqs": len(scheduler.running),
            "num_waiting_seqs": len(scheduler.waiting),
            "num_preempted_seqs": sum(1 for s in scheduler.waiting if s.num_preemptions),
            "num_preemptions_total": scheduler.num_preemptions,
            # tenant -> counter, served tokens, preemptions, queue time; and its sequences waiting now
            "tenants": scheduler.fair.shares(),
            "waiting_by_tenant": dict(Counter(s.tenancy.tenant for s in scheduler.waiting)),
            "running_by_tenant": dict(Counter(s.tenancy.tenant for s in scheduler.running)),
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_utilization": self.kv_utilization(),
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
            "prefix_cache_evictions": bm.num_evictions,
            "memory_bytes": {
                "weights": self.runner.weights_bytes,
                "kv_cache": self.capacity.num_bytes,
                "peak": self.peak_memory_bytes(),
            },
            "prompt_tokens_per_s": prompt_rate,
            "generation_tokens_per_s": generation_rate,
            "prompt_tokens_total": self.meter.num_prompt_tokens,
            "generation_tokens_total": self.meter.num_generation_tokens,
            "num_steps": self.meter.num_steps,
            "max_model_len": self.max_model_len,
            "capacity": self.capacity.as_dict(),
            **(self.speculator.stats() if self.speculator is not None else off_stats()),
        }


def _num_prompt_tokens(batch: ScheduledBatch) -> int:
    """The prompt tokens `batch` computes (read before `Scheduler.postprocess` moves `num_computed_tokens`)."""
    return sum(
        min(n, max(0, s.num_prompt_tokens - s.num_computed_tokens))
        for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
    )


def _collect(
    changed: dict[str, tuple[_Request, list[CompletionOutput]]], request: _Request, out: CompletionOutput
) -> None:
    """Add one sequence's output of this step to its request's entry."""
    entry = changed.get(request.request_id)
    if entry is None:
        changed[request.request_id] = (request, [out])
    else:
        entry[1].append(out)


def _warn_sliding_window(source: str, model_config: ModelConfig, engine_config: EngineConfig) -> None:
    """Say so when a sliding window caps the served context (`EngineConfig.resolved_max_model_len`)."""
    window = model_config.sliding_window
    if window is None:
        return
    uncapped = engine_config.resolved_max_model_len(dataclasses.replace(model_config, sliding_window=None))
    if uncapped > window:
        logger.warning(
            "%s (%s) uses sliding-window attention over %d tokens, which this engine does not implement: the served "
            "context is capped at %d tokens (was %d); longer requests get 400 context_length_exceeded",
            source,
            model_config.model_type,
            window,
            window,
            uncapped,
        )
