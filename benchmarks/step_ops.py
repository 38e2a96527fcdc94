"""Where one engine step's time goes, call by call, C kernels included (they run through
ctypes, so `benchmarks.profile_step`'s torch profiler does not see them): a clock around
each call the step makes, summed over the step's layers.

    python -m benchmarks.step_ops --prefill 1676     # a prompt's step: each layer op
    python -m benchmarks.step_ops --batch 32         # a decode step: layers, LM head, host

A prefill step is split into the layer's ops (q/k/v, RoPE + KV store, attention, o,
RMSNorm, gate_up with SiLU, down) and "rest" (embedding, the LM head, the Python between
them); a decode step into the layers (one C call each where the native decode path runs),
the final RMSNorm, the LM head, and the host's own parts (schedule, plan, inputs and
metadata, sampling). The clocks add ~1 us a call. Each row is one step; the first is a
warm-up and is not shown.
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable, Sequence

import torch

import engine.model as model_module
from benchmarks.profile_step import random_prompts, start_decoding, step_llm
from engine import LLM, SamplingParams
from engine.kernels import decode_layers_cpu
from engine.named_models import DEFAULT_MODEL


class Clocks:
    """Seconds per label, summed until ``take()``. A clocked call made inside another one is
    the outer one's time (a layer's RMSNorm is part of "layers", not of "final_norm")."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self._depth = 0

    def wrap(self, label: str, call: Callable) -> Callable:
        def timed(*args, **kwargs):
            if self._depth:
                return call(*args, **kwargs)
            self._depth += 1
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - started
                self._depth -= 1

        return timed

    def take(self) -> dict[str, float]:
        taken, self.seconds = dict(self.seconds), collections.defaultdict(float)
        return taken


# setattr, or a test's monkeypatch.setattr (which undoes it): the module- and class-level
# clocks outlive the engine they were put in for.
Patch = Callable[[object, str, object], None]


def clock_prefill_ops(llm: LLM, clocks: Clocks, patch: Patch) -> list[str]:
    """Clocks on every decoder layer's calls; the labels, in a layer's order."""
    for name, label in (
        ("rmsnorm", "rmsnorm"),
        ("rope_and_store_cpu", "rope+store"),
        ("prefill_attention", "attention"),
    ):
        patch(model_module, name, clocks.wrap(label, getattr(model_module, name)))
    for layer in llm.engine.model.layers:
        names = {
            id(layer.qkv_weight): "qkv",
            id(layer.o_weight): "o",
            id(layer.gate_up_weight): "gate_up",
            id(layer.down_weight): "down",
        }
        timed = {name: clocks.wrap(name, layer.linear) for name in names.values()}
        layer.linear = lambda x, weight, *a, _t=timed, _n=names, **k: _t[_n[id(weight)]](
            x, weight, *a, **k
        )
    return ["qkv", "rope+store", "attention", "o", "rmsnorm", "gate_up", "down"]


def clock_decode_parts(llm: LLM, clocks: Clocks, patch: Patch) -> list[str]:
    """Clocks on a decode step's parts; the labels, in a step's order."""
    engine = llm.engine
    # The layers as one C call each where the native decode path runs (bf16 on AMX), else
    # op by op: whichever this CPU's step takes.
    native = decode_layers_cpu.NativeDecodeLayers
    patch(native, "__call__", clocks.wrap("layers", native.__call__))
    layer = model_module.DecoderLayer
    patch(layer, "forward", clocks.wrap("layers", layer.forward))
    # outside the layers, the model's one RMSNorm call is the final norm
    patch(model_module, "rmsnorm", clocks.wrap("final_norm", model_module.rmsnorm))
    model = engine.model
    model.compute_logits = clocks.wrap("lm_head", model.compute_logits)
    engine.scheduler.schedule = clocks.wrap("schedule", engine.scheduler.schedule)
    engine.runner.plan = clocks.wrap("plan", engine.runner.plan)
    engine.runner.inputs = clocks.wrap("inputs", engine.runner.inputs)
    engine.sampler.sample = clocks.wrap("sample", engine.sampler.sample)
    return ["schedule", "plan", "inputs", "layers", "final_norm", "lm_head", "sample"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill", type=int, default=0, help="time one prompt this long")
    parser.add_argument("--batch", type=int, default=1, help="else: decode this many sequences")
    parser.add_argument("--context", type=int, default=128, help="decode: each prompt's length")
    parser.add_argument("--steps", type=int, default=6, help="steps timed (prompts, for --prefill)")
    return parser.parse_args(argv)


def run(args: argparse.Namespace, patch: Patch = setattr) -> list[str]:
    """The table's lines: a header, then one row of milliseconds per timed step."""
    torch.set_num_threads(args.threads)
    llm = step_llm(
        args.model,
        args.dtype,
        prefill=args.prefill,
        batch=args.batch,
        context=args.context,
        steps=args.steps,
        enable_prefix_caching=False,
    )
    engine, clocks = llm.engine, Clocks()
    prompt = random_prompts(engine)

    rows = []
    if args.prefill:
        labels = clock_prefill_ops(llm, clocks, patch)
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        for _ in range(args.steps + 1):
            engine.add_request(prompt(args.prefill), one)
            started = time.perf_counter()
            engine.step()
            rows.append((time.perf_counter() - started, clocks.take()))
            while engine.has_unfinished():
                engine.step()
        title = f"prefill of {args.prefill} tokens"
    else:
        params = SamplingParams(max_tokens=args.steps + 3, temperature=0, ignore_eos=True)
        start_decoding(engine, [prompt(args.context) for _ in range(args.batch)], params)
        labels = clock_decode_parts(llm, clocks, patch)
        for _ in range(args.steps + 1):
            started = time.perf_counter()
            engine.step()
            rows.append((time.perf_counter() - started, clocks.take()))
        title = f"decode step, batch {args.batch}, context {args.context}"
    lines = [
        f"{args.model} {engine.dtype} threads={torch.get_num_threads()}: {title}, ms",
        " ".join(f"{label:>11}" for label in ["step", *labels, "rest"]),
    ]
    for step_s, parts in rows[1:]:
        rest = step_s - sum(parts.values())
        values = [step_s, *(parts.get(label, 0.0) for label in labels), rest]
        lines.append(" ".join(f"{value * 1e3:11.2f}" for value in values))
    llm.close()
    return lines


def main() -> None:
    print("\n".join(run(parse_args())))


if __name__ == "__main__":
    main()
