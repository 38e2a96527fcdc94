"""The engine loop: schedule → run → postprocess, over a paged KV cache.

``LLMEngine`` takes requests (``add_request``), advances every unfinished one by a step
(``step``) and hands back those that finished. It is the core that the offline ``LLM``, the
colocated baseline and the workers build on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.block_manager import BlockManager, kv_cache_misfit
from engine.checkpoint import Checkpoint
from engine.config import EngineConfig
from engine.cpu_gemm import GemmPlan, QuantizedGemm, cached_plan, limit_blas_threads
from engine.cuda_graphs import DecodeGraphs, warm_up_kernels
from engine.errors import EngineError, InvalidRequestError
from engine.host_kv_tier import HostKVTier
from engine.host_memory import keep_freed_host_memory
from engine.kernels import cpu_native
from engine.kernels.cpu_attention import choose_prefill_kernel
from engine.kernels.decode_layers_cpu import NativeDecodeLayers
from engine.kv_cache import PagedKVCache
from engine.load import EngineLoad
from engine.model import LlamaModel
from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput
from engine.sampler import Sampler, token_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Fork, Sequence, SequenceStatus, TokenLogprobs
from engine.step_cost import StepCostModel
from engine.stop_checker import StopChecker
from engine.tensor_parallel import ShardLayout
from engine.tp_group import TPGroup
from engine.tp_worker import (
    RankServiceFactory,
    ToRank,
    WorkerSpec,
    rank_device,
    spawn_workers,
    stop_workers,
    wait_ready,
)

logger = logging.getLogger(__name__)


PROMPT_LOGITS_ROWS = 256  # prompt logprobs: logits of this many positions at a time


@dataclass
class StepResult:
    """What one step produced: every token sampled (request id, token, logprobs or None),
    the requests that finished, and the prompt logprobs of requests whose first token this
    is (when they asked)."""

    new_tokens: list[tuple[str, int, TokenLogprobs | None]]
    finished: list[RequestOutput]
    seconds: float = 0.0  # the step's wall time
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)


@dataclass(frozen=True)
class LayerCallbacks:
    """What a layer hook may return instead of a bare ``layer_done``: the callback, and data
    for the other ranks' services that goes with this step's plan (tp_worker.RankService)."""

    layer_done: Callable[[int], None] | None
    rank_data: Any = None


def cpu_gemm_plan(model, choice: str, quantized: QuantizedGemm | None = None) -> GemmPlan:
    """The GEMM backend per row count: for "auto", measured on this machine (once: cached).
    ``quantized``: the GGUF blocks of the model's weights, if it has any."""
    limit_blas_threads(torch.get_num_threads())
    quantized = quantized or QuantizedGemm()
    if choice != "auto":
        from engine.cpu_gemm import BUCKETS

        return GemmPlan(choices=dict.fromkeys(BUCKETS, choice), quantized=quantized)
    with torch.inference_mode():
        plan = cached_plan(
            model.gemm_weights(), quantized=quantized, silu_mul_weights=model.silu_mul_weights()
        )
    logger.info("CPU GEMM plan (rows: backend): %s", plan.describe())
    return plan


def load_shard(
    checkpoint: Checkpoint,
    config: EngineConfig,
    device: torch.device,
    max_model_len: int,
    tp: TPGroup,
    *,
    progress: bool,
) -> tuple[LlamaModel, GemmPlan | None]:
    """The model (``tp``'s rank's shard of it) in the config's dtype on ``device``, its GEMMs
    through the CPU plan on CPU: what every rank of an engine builds first."""
    torch.manual_seed(config.seed)
    model = checkpoint.load_model(
        config.resolve_dtype(device), device, max_model_len, tp, progress=progress
    )
    if device.type != "cpu":
        return model, None
    keep_freed_host_memory()
    quantized = QuantizedGemm(checkpoint.gemm_blocks(model) if config.gguf_gemm else ())
    plan = cpu_gemm_plan(model, config.cpu_gemm, quantized)
    with torch.inference_mode():
        plan.prepare(model.gemm_weights(), model.silu_mul_weights())
    model.use_linear(plan.linear)
    cpu_native.library()  # built now (seconds, once per machine), not in the first request
    model.use_native_decode(NativeDecodeLayers.build(model, plan))
    if model.norm_weight.dtype == torch.bfloat16:
        c = model.config
        choose_prefill_kernel(c.num_heads, c.num_kv_heads, c.head_dim)
    return model, plan


class LLMEngine:
    """One replica's engine. With ``tensor_parallel_size`` t > 1 it is rank 0 of t: it
    schedules and samples, and its model runner has ranks 1..t-1 (child processes, see
    engine.tp_worker) run their shards of every forward in step; ``close`` ends them.
    ``rank_service`` gives each of those ranks a service (its KV transfer side, say)."""

    def __init__(
        self,
        model: str | Path,
        config: EngineConfig | None = None,
        *,
        progress: bool = True,
        rank_service: RankServiceFactory | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        self.model_name = str(model)
        checkpoint = Checkpoint(model)
        self.model_config = checkpoint.config
        tp_size = config.tensor_parallel_size
        self.layout = ShardLayout(self.model_config, tp_size, 0)  # refuses degrees that misfit
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_model_len, self.model_config.max_model_len
        )
        kv_dtype = config.resolve_kv_cache_dtype(self.dtype)
        local_config = self.layout.local_config  # this rank's heads: its cache's shape
        num_blocks = config.num_kv_blocks or config.blocks_for_memory(local_config, kv_dtype)
        self.tp, self._tp_processes = TPGroup.single(), []
        self.rank_infos: list[Any] = []  # ranks 1..t-1: their services' info()
        if tp_size > 1:
            self._start_tensor_parallel(model, num_blocks, rank_service)
        try:
            self.model, self.gemm_plan = load_shard(
                checkpoint, config, self.device, self.max_model_len, self.tp, progress=progress
            )
            self.rank_infos = wait_ready(self.tp, self._tp_processes)
        except BaseException:
            self.close()
            raise
        self.tokenizer = checkpoint.tokenizer()
        self.cache = PagedKVCache(
            local_config, num_blocks, config.block_size, kv_dtype, self.device
        )
        num_host_blocks = config.host_blocks_for(self.cache.bytes_per_block())
        # Beside the cache, same block shape (tp 1 only: EngineConfig refuses more).
        self.host_tier = HostKVTier(self.cache, num_host_blocks) if num_host_blocks else None
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching, self.host_tier
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            preemption_mode=config.preemption_mode,
            prefill_token_s=self._prefill_token_s,
        )
        self.runner = ModelRunner(self.model, self.cache)
        self.sampler = Sampler(config.seed, self.model_config.vocab_size, self.tokenizer)
        self.stop_checker = StopChecker(self.tokenizer, self.max_model_len)
        self._requests: dict[str, Sequence] = {}
        self._fork_parent: dict[str, Sequence] = {}  # a fork not spawned yet → its prompt's seq
        self._prompts: dict[str, str | None] = {}
        self.num_prompt_tokens_computed = 0  # prompt tokens that went through the model
        self.step_cost = StepCostModel()  # this replica's capacity, from its own steps
        if self.device.type == "cuda":
            self._warm_up_cuda()
            self.num_prompt_tokens_computed = 0
            self.step_cost = StepCostModel()  # compiles and captures are not its steps

    def _prefill_token_s(self) -> float | None:
        """Seconds per prompt token as this replica's steps measured them (None before any):
        what the scheduler weighs a recompute at."""
        cost = self.step_cost.estimate()
        return cost.per_token_s if cost is not None and cost.per_token_s > 0 else None

    def _start_tensor_parallel(
        self, model: str | Path, num_blocks: int, service: RankServiceFactory | None
    ) -> None:
        """Start ranks 1..t-1 and meet them; each loads its shard while this one does."""
        size = self.layout.size
        if self.device.type == "cuda":
            first = self.device.index or 0
            if first + size > torch.cuda.device_count():
                raise EngineError(
                    f"tensor_parallel_size {size} from cuda:{first} needs GPUs {first}-"
                    f"{first + size - 1}, but this machine has {torch.cuda.device_count()}"
                )
        threads = max(1, torch.get_num_threads() // size)
        if self.device.type == "cpu":
            torch.set_num_threads(threads)  # the ranks share this machine's cores
        meeting, store, listener = TPGroup.rendezvous(size, self.device)
        specs = [
            WorkerSpec(
                source=str(model),
                config=dataclasses.replace(self.config, device=str(rank_device(self.device, rank))),
                rank=rank,
                meeting=meeting,
                num_threads=threads,
                num_blocks=num_blocks,
                max_model_len=self.max_model_len,
                service=service,
            )
            for rank in range(1, size)
        ]
        self._tp_processes = spawn_workers(specs)
        self.tp = TPGroup.join_as_driver(meeting, store, listener, self.device)
        processes = self._tp_processes
        self.tp.watch(lambda: all(p.is_alive() for p in processes))
        self._finalizer = weakref.finalize(self, stop_workers, self.tp, self._tp_processes)
        logger.info(
            "tensor parallel %d: rank 0 here, ranks 1-%d in processes %s",
            size,
            size - 1,
            [p.pid for p in self._tp_processes],
        )

    def send_to_ranks(self, payload: Any) -> None:
        """Hand ``payload`` to every other rank's service, in order with the steps (the
        caller holds the engine's lock). Raises TensorParallelError if a rank is gone."""
        self.tp.send(ToRank(payload))

    def listen_to_ranks(
        self, deliver: Callable[[Any], None], on_lost: Callable[[int], None]
    ) -> None:
        """Deliver every ``FromRank`` message of the ranks' services (on listener threads);
        ``on_lost(rank)`` when a rank's process goes away while the engine is not closing."""
        self.tp.listen(deliver, on_lost)

    def close(self, force: bool = False) -> None:
        """End the tensor-parallel ranks (a no-op at tp 1); ``force``: kill them at once (a
        rank is lost and the rest may be waiting for it). The engine is unusable after."""
        finalizer = getattr(self, "_finalizer", None)
        self.tp.stopping = True
        if force:
            for process in self._tp_processes:
                process.kill()
        if finalizer is not None:
            finalizer()
        elif self._tp_processes:
            stop_workers(self.tp, self._tp_processes)

    def _warm_up_cuda(self) -> None:
        """Compile and tune every kernel variant, run one request end to end, then capture
        the decode graphs: serving never waits for a compile."""
        if self.tp.size == 1:  # the ranks would have to warm up in lockstep: not done yet
            warm_up_kernels(self.model, self.cache, self.config.max_num_batched_tokens)
        # Triton compiles a kernel again for each specialisation of its integer arguments
        # (equal to 1, a multiple of 16, neither): on an H200 the first 256-token prompt
        # after a 17-token probe took 1.56 s, the next ones 23 ms. So prompts of 17 and 32
        # tokens alone, then both together (prefix-cache hits), reach each variant.
        odd, even = list(range(1, 18)), list(range(18, 50))
        for n, prompts in enumerate(([odd], [even], [odd, even])):
            probes = [
                self.add_request(
                    p, SamplingParams(max_tokens=2, ignore_eos=True), f"warm-up-{n}-{i}"
                )
                for i, p in enumerate(prompts)
            ]
            while any(self.has_request(probe.request_id) for probe in probes):
                self.step()
        if self.config.cuda_graphs and self.tp.size == 1:  # no collectives inside the graphs yet
            graphs = DecodeGraphs(
                self.model, self.cache, min(self.config.max_num_seqs, 256), self.max_model_len
            )
            graphs.capture()
            self.runner.graphs = graphs

    # ---- requests ---------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | Seq[int]) -> list[int]:
        """Text → token ids (with BOS), or validate a list of token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.model_config.vocab_size
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"prompt token id {t!r} is outside the vocabulary [0, {vocab})"
                )
        return ids

    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams, forks: Seq[Fork] = ()
    ) -> None:
        """Raise InvalidRequestError if this engine could never serve the request."""
        self._check_group(self.tokenize_prompt(prompt_token_ids), params, forks)

    def _check_fits(self, ids: list[int], params: SamplingParams) -> None:
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the model's limit is {self.max_model_len} "
                "including at least one generated token"
            )
        misfit = kv_cache_misfit(
            len(ids),
            params.max_tokens,
            self.max_model_len,
            self.block_manager.block_size,
            self.block_manager.num_blocks,
        )
        if misfit is not None:
            raise InvalidRequestError(misfit)
        for t in params.stop_token_ids:
            if t >= self.model_config.vocab_size:
                raise InvalidRequestError(f"stop_token_ids entry {t} is outside the vocabulary")
        for t, _ in params.logit_bias:
            if t >= self.model_config.vocab_size:
                raise InvalidRequestError(f"logit_bias token id {t} is outside the vocabulary")
        if params.grammar is not None:
            self.sampler.grammar_masks().compiler.compile(params.grammar)

    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        forks: Seq[Fork] = (),
    ) -> Sequence:
        """Queue a request; each of ``forks`` is another sequence of the same prompt,
        prefilled once with it (OpenAI's ``n``), reported under its own request id."""
        params = params or SamplingParams()
        ids = self.tokenize_prompt(prompt)  # token ids checked here, once
        self._check_group(ids, params, forks)
        seq = Sequence(prompt_token_ids=ids, params=params, request_id=request_id or "")
        self._check_ids_free([seq.request_id, *(f.request_id for f in forks)])
        seq.forks = tuple(forks)
        self._requests[seq.request_id] = seq
        self._prompts[seq.request_id] = prompt if isinstance(prompt, str) else None
        for fork in forks:
            self._fork_parent[fork.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _check_group(self, ids: list[int], params: SamplingParams, forks: Seq[Fork]) -> None:
        for p in (params, *(f.params for f in forks)):
            self._check_fits(ids, p)
        if 1 + len(forks) > self.config.max_num_seqs:
            raise InvalidRequestError(
                f"{1 + len(forks)} sequences of one prompt exceed this engine's limit of "
                f"{self.config.max_num_seqs} running at once"
            )

    def _check_ids_free(self, request_ids: list[str]) -> None:
        if len(set(request_ids)) != len(request_ids):
            raise InvalidRequestError(f"request ids {request_ids} repeat one")
        for request_id in request_ids:
            if request_id in self._requests or request_id in self._fork_parent:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")

    def describe(self) -> dict:
        """What a serving worker reports about this engine (fixed for its lifetime)."""
        return {
            "fingerprint": self.model_config.fingerprint(),
            "block_size": self.cache.block_size,
            "num_blocks": self.cache.num_blocks,
            "kv_cache_dtype": str(self.cache.dtype),
            "max_model_len": self.max_model_len,
            "vocab_size": self.model_config.vocab_size,
            "max_num_seqs": self.config.max_num_seqs,
            "num_host_kv_blocks": self.host_tier.num_slots if self.host_tier else 0,
            "tensor_parallel": {
                "size": self.layout.size,
                "rank_pids": [os.getpid(), *(p.pid for p in self._tp_processes)],
                "kv_heads": [list(heads) for heads in self.layout.kv_heads_by_rank()],
            },
        }

    def load(self) -> EngineLoad:
        """Its current load: queues, KV blocks, cache hits (callers hold the engine's lock)."""
        now = time.monotonic()
        bm = self.block_manager
        waiting = self.scheduler.waiting
        return EngineLoad(
            running=len(self.scheduler.running),
            waiting=len(waiting),
            queued_tokens=sum(s.num_uncomputed_tokens for s in waiting),
            oldest_wait_s=max((now - s.arrival_time for s in waiting), default=0.0),
            num_blocks=bm.num_blocks,
            free_blocks=bm.num_free_blocks,
            kv_usage=bm.num_used_blocks / bm.num_blocks,
            prefix_hit_tokens=bm.prefix_hit_tokens,
            prefix_query_tokens=bm.prefix_query_tokens,
            step_cost=self.step_cost.estimate(),
            prompt_tokens_computed=self.num_prompt_tokens_computed,
            preemptions=self.scheduler.num_preemptions,
            max_num_seqs=self.config.max_num_seqs,
            **self.tier_load(),
        )

    def tier_load(self) -> dict[str, int]:
        """The host KV tier's and the preemptions' counters (``EngineLoad``'s fields of the
        same names; all 0 but the recomputes without a tier)."""
        scheduler, bm = self.scheduler, self.block_manager
        stats = self.host_tier.stats() if self.host_tier is not None else None
        return {
            "recomputes": scheduler.num_recomputes,
            "swaps_out": scheduler.num_swaps_out,
            "swaps_in": scheduler.num_swaps_in,
            "host_blocks": stats.num_slots if stats else 0,
            "host_blocks_used": stats.used_slots if stats else 0,
            "host_hit_tokens": bm.host_hit_tokens,
            "host_offloads": stats.offloads if stats else 0,
            "host_loads": stats.loads if stats else 0,
        }

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests or request_id in self._fork_parent

    def request_ids(self) -> list[str]:
        return [*self._requests, *self._fork_parent]

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request (or a fork not spawned yet); None if there is no such request.
        Aborting a prompt whose forks are not spawned yet hands the prompt, computed so far,
        to its first fork."""
        parent = self._fork_parent.pop(request_id, None)
        if parent is not None:
            parent.forks = tuple(f for f in parent.forks if f.request_id != request_id)
            return self._aborted_output(request_id, parent)
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        if seq.forks:
            heir, *rest = seq.forks
            del self._fork_parent[heir.request_id]
            output = self._aborted_output(request_id, seq)
            self._requests[heir.request_id] = self._requests.pop(request_id)
            self._prompts[heir.request_id] = self._prompts.pop(request_id)
            seq.request_id, seq.params, seq.forks = heir.request_id, heir.params, tuple(rest)
            return output
        self.scheduler.finish(seq, "abort")
        return self._release(seq)

    def _aborted_output(self, request_id: str, seq: Sequence) -> RequestOutput:
        """The output of a request aborted before its first token, sharing ``seq``'s prompt."""
        return RequestOutput(
            request_id=request_id,
            prompt=self._prompts.get(seq.request_id),
            prompt_token_ids=seq.prompt_token_ids,
            text="",
            token_ids=[],
            finish_reason="abort",
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop ---------------------------------------------------------------------
    def step(
        self, layer_hook: Callable[[ScheduledBatch], Callable[[int], None]] | None = None
    ) -> StepResult:
        """Run one batch: schedule → forward → sample and check stops.

        ``layer_hook(batch)``, if given, returns the ``layer_done(i)`` callback the model calls
        after each layer (the prefill worker streams KV from it), or LayerCallbacks."""
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch is None:
            return StepResult([], [])
        prompt_tokens = 0
        layer_done = layer_hook(batch) if layer_hook is not None else None
        rank_data = None
        if isinstance(layer_done, LayerCallbacks):
            layer_done, rank_data = layer_done.layer_done, layer_done.rank_data
        logits, sampling, prompt_hidden = self.runner.run(batch, layer_done, rank_data)
        for i, hidden in prompt_hidden.items():
            self._record_prompt_logprobs(batch.seqs[i], hidden)
        for seq, count in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                prompt_tokens += min(count, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += count
            seq.num_registered_blocks = self.block_manager.register_full_blocks(
                seq.block_table, seq.token_ids, seq.num_computed_tokens, seq.num_registered_blocks
            )
        result = StepResult([], [])
        if sampling:
            seqs = [batch.seqs[i] for i in sampling]
            rows = list(range(len(seqs)))  # each sequence's row of the logits
            for row, seq in enumerate(list(seqs)):
                if seq.forks:  # its prompt is done: its forks sample from the same logits
                    children = [self._spawn(seq, fork) for fork in seq.forks]
                    seq.forks = ()
                    seqs += children
                    rows += [row] * len(children)
            if len(rows) > len(sampling):
                logits = logits[torch.tensor(rows, device=logits.device)]
            tokens, logprobs = self.sampler.sample(logits, seqs)
            for seq, token, lp in zip(seqs, tokens, logprobs, strict=True):
                self._accept_token(seq, token, lp, result)
        self.num_prompt_tokens_computed += prompt_tokens
        result.seconds = time.perf_counter() - started
        decode_rows = 0 if prompt_tokens else len(batch.seqs)
        self.step_cost.record(decode_rows, prompt_tokens, result.seconds)
        return result

    def admit_prefilled(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        block_ids: list[int],
        first_token: int,
        forks: Seq[tuple[Fork, int]] = (),
    ) -> tuple[Sequence, StepResult]:
        """Start decoding a request whose prompt K/V another worker computed into ``block_ids``
        of this cache, with the first token it sampled; each of ``forks`` (a fork and its
        first token) decodes too, sharing those blocks. The blocks now belong to the
        sequences (freed when the last finishes). Returns the request's sequence and the
        first tokens' StepResult."""
        seq = Sequence(
            prompt_token_ids=list(prompt_token_ids), params=params, request_id=request_id
        )
        self._check_ids_free([request_id, *(f.request_id for f, _ in forks)])
        seq.block_table = list(block_ids)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.num_registered_blocks = self.block_manager.register_full_blocks(
            seq.block_table, seq.token_ids, seq.num_computed_tokens
        )
        self._requests[seq.request_id] = seq
        self._prompts[seq.request_id] = None
        self.scheduler.running.append(seq)
        group = [seq, *(self._spawn(seq, fork) for fork, _ in forks)]
        result = StepResult([], [])
        for member, token in zip(group, [first_token, *(t for _, t in forks)], strict=True):
            self.sampler.skip_first_draw(member.seq_id, member.params, self.device)
            self._accept_token(member, token, None, result)
        return seq, result

    def _spawn(self, seq: Sequence, fork: Fork) -> Sequence:
        """``fork`` starts as a running sequence sharing ``seq``'s prompt and its blocks."""
        self._fork_parent.pop(fork.request_id, None)
        child = Sequence(
            prompt_token_ids=seq.prompt_token_ids,
            params=fork.params,
            request_id=fork.request_id,
            arrival_time=seq.arrival_time,
        )
        child.block_table = self.block_manager.fork(seq.block_table)
        child.num_computed_tokens = seq.num_computed_tokens
        child.num_cached_tokens = seq.num_cached_tokens
        child.num_registered_blocks = seq.num_registered_blocks
        child.prompt_logprobs = seq.prompt_logprobs
        child.status = SequenceStatus.RUNNING
        self._requests[child.request_id] = child
        self._prompts[child.request_id] = self._prompts[seq.request_id]
        self.scheduler.running.append(child)
        return child

    @staticmethod
    def _computed_prompt_logprobs(seq: Sequence) -> bool:
        """Whether this engine computed ``seq``'s prompt logprobs (not a prefill worker)."""
        return len(seq.prompt_logprobs) == seq.num_prompt_tokens

    def _record_prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """The logprobs of the prompt tokens that this chunk's positions predict (position p
        predicts token p + 1); positions already recorded (a recompute) are skipped."""
        start = seq.num_computed_tokens
        end = min(start + hidden.shape[0], seq.num_prompt_tokens - 1)
        k = seq.params.prompt_logprobs
        for lo in range(max(start, len(seq.prompt_logprobs) - 1), end, PROMPT_LOGITS_ROWS):
            hi = min(lo + PROMPT_LOGITS_ROWS, end)
            logits = self.model.compute_logits(hidden[lo - start : hi - start])
            targets = torch.tensor(seq.token_ids[lo + 1 : hi + 1], device=logits.device)
            seq.prompt_logprobs += token_logprobs(logits, targets, [k] * (hi - lo))

    def _accept_token(self, seq: Sequence, token: int, logprob, result: StepResult) -> None:
        seq.status = SequenceStatus.RUNNING
        self.sampler.accept(seq, token)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
            if seq.params.prompt_logprobs is not None and self._computed_prompt_logprobs(seq):
                result.prompt_logprobs[seq.request_id] = seq.prompt_logprobs
        self._append_token(seq, token, logprob)
        result.new_tokens.append((seq.request_id, token, logprob))
        if seq.is_finished:
            result.finished.append(self._release(seq))

    def _append_token(self, seq: Sequence, token: int, logprob) -> None:
        seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        reason = self.stop_checker.finish_reason(seq, token)
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _release(self, seq: Sequence) -> RequestOutput:
        del self._requests[seq.request_id]
        prompt = self._prompts.pop(seq.request_id)
        self.sampler.forget(seq.seq_id)
        self.stop_checker.forget(seq.seq_id)
        seq.finish_time = time.monotonic()
        text = self.tokenizer.decode(seq.output_token_ids)
        if seq.stop_text_len is not None:
            text = text[: seq.stop_text_len]
        metrics = {"latency_s": seq.finish_time - seq.arrival_time}
        if seq.first_token_time is not None:
            metrics["ttft_s"] = seq.first_token_time - seq.arrival_time
        return RequestOutput(
            request_id=seq.request_id,
            prompt=prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=text,
            token_ids=seq.output_token_ids,
            finish_reason=seq.finish_reason or "abort",
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=seq.logprobs if seq.params.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
            metrics=metrics,
        )
