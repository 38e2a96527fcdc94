"""GEMMs on CPU through the fastest BLAS at hand for each row count, chosen by measurement.

Three libraries compute ``x @ W.T`` here: torch's ``F.linear`` (MKL), oneDNN's inner product
(``torch.ops.mkldnn._linear_pointwise``), and OpenBLAS (the one numpy ships); on CPUs with
AMX, our own bf16 kernel on AMX tiles ("amx", engine.kernels.amx_gemm) too. oneDNN also
runs on weights reordered once into its own blocked layout ("onednn-packed"); given the plain
layout it reorders them on every call, which costs a GEMV about a third of its time. Their
speed differs by up to 2x on the same machine and shape, and which wins depends on the CPU:
on this project's AMD machines MKL reads a GEMV's weights at half the bandwidth OpenBLAS
does, while Intel CPUs with AMX favour MKL and oneDNN. So a replica times
each library on its own weights once, at start-up (``GemmPlan.measure``), for each bucket of
row counts (1, 2, 4, ... tokens in a step), and routes every GEMM by its row count.

Above COLD_SWEEP_ROWS (a prompt's GEMMs, bound by compute) each weight shape is timed
apart, and a shape whose own fastest backend beats the bucket's by SHAPE_MARGIN runs on it
(at 1,676 rows here oneDNN won q/k/v and o, our AMX kernel the down projection by 10-15%).

A GEMV is bound by reading the weights, which do not fit the caches: the measurement sweeps
the weights of several layers, so each is read cold as in a real decode step. A GGUF model's
weights may also run on their GGUF blocks ("gguf", engine.kernels.quantized_cpu: a fifth to
an eighth of the bytes). "gguf" and "amx" take only some weights (those with blocks; bf16
ones of whole tiles), so the plan also keeps, per row count, the fastest backend that takes
every weight: the fallback for the weights they decline.

The plan is measured once per machine and model shape and kept on disk (``cached_plan``):
every replica on a machine then computes with the same libraries, so their results round
alike (a request moved between replicas continues exactly), and start-up skips the timing.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from engine import cpu_isa
from engine.kernels import cpu_native
from engine.kernels.amx_gemm import AmxGemm, amx_shares_rows
from engine.kernels.fused_cpu import silu_mul_native
from engine.kernels.quantized_cpu import QuantizedWeight, quantized_linear

# Row counts timed; a count routes to the first bucket at or above it, past the last to the
# last. 2048 stands for long prompts: a backend that wins at 512 may lose badly at 1,676+
# (the AMX kernel: 2.0 against oneDNN's 2.6 TFLOP/s here), so 512's choice must not reach them.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048)
T = TypeVar("T")
# Part of the cache key: format 7's plans let gate_up's plain GEMM pick the other shapes'
# backend where it runs fused (and format 6's had no shape_choices).
PLAN_FORMAT = 8
# Row counts whose plan sweeps every weight cold: at 1 thread and 128 rows the AMX kernel ran
# a forward's GEMMs ~10% faster than oneDNN, and ~8% slower on weights the caches held.
COLD_SWEEP_ROWS = 256


def _torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    return F.linear(x, weight, bias)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _openblas_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    out = torch.from_numpy(np.matmul(x.contiguous().numpy(), weight.numpy().T))
    return out if bias is None else out.add_(bias)


class PackedOneDNN:
    """oneDNN's inner product on weights reordered once into its blocked layout.

    Each weight is packed on its first use and kept while the weight lives (keyed by the
    tensor object, not its address, so a freed weight's packing is never reused): one more
    copy of every GEMM weight in memory. In bf16 the packed layout gives bitwise oneDNN's
    results on the plain weight; in fp32 a one-row GEMV rounds differently (tests)."""

    # The row count oneDNN picks its layout for; measured here, 1-256 differ by noise only.
    PACK_ROWS = 32

    def __init__(self) -> None:
        self._packed: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.pack(weight), bias, "none", [], "")

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        packed = self._packed.get(weight)
        if packed is None:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), self.PACK_ROWS)
            self._packed[weight] = packed
        return packed


class QuantizedGemm:
    """GEMMs on GGUF blocks for the weights that have them (given once, at load) and fp32
    inputs; ``__call__`` returns None for any other, and the plan runs it dense."""

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, QuantizedWeight]] = ()) -> None:
        self.blocks: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for weight, blocks in pairs:
            self.blocks[weight] = blocks

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        blocks = self.blocks.get(weight)
        return None if blocks is None else quantized_linear(x, blocks, bias)

    def describe(self) -> str:
        """What the plan key holds of them: each weight's block type and shape."""
        return ",".join(
            sorted(f"{b.kind}:{b.out_features}x{b.in_features}" for b in self.blocks.values())
        )


# Stateless backends; "onednn-packed" and "amx" hold packings and "gguf" blocks, so each
# GemmPlan has its own.
BACKENDS: dict[str, Callable] = {
    "torch": _torch_linear,
    "onednn": _onednn_linear,
    "openblas": _openblas_linear,
}
# The backends that may decline a weight (returning None): the plan's fallback runs those.
PARTIAL_BACKENDS = ("gguf", "amx")
BACKEND_NAMES = (*BACKENDS, "onednn-packed", *PARTIAL_BACKENDS)


def available_backends(dtype: torch.dtype, threads: int) -> list[str]:
    """The backends that take every weight of ``dtype`` here."""
    names = ["torch"]
    if torch.backends.mkldnn.is_available():
        names += ["onednn", "onednn-packed"]
    # numpy has no bf16 (and its fp16 GEMM is not BLAS). With more than one thread,
    # OpenBLAS's pool and torch's OpenMP pool spin against each other between calls:
    # measured here, a decode step took 3x longer, which GEMMs timed alone do not show.
    if dtype == torch.float32 and threads == 1:
        names.append("openblas")
    return names


@dataclass
class GemmPlan:
    """Which backend runs a GEMM of a given row count (rows above the last bucket use the
    last bucket's choice). Built once per replica; read by every linear layer."""

    choices: dict[int, str] = field(default_factory=dict)  # bucket → backend name
    # bucket → the backend for the weights the choice declines (where it is "gguf" or "amx")
    fallback_choices: dict[int, str] = field(default_factory=dict)
    timings_ms: dict[int, dict[str, float]] = field(default_factory=dict)
    # bucket → {weight shape "out x in" → backend}: the shapes whose own fastest backend beats
    # the bucket's choice by SHAPE_MARGIN (measured above COLD_SWEEP_ROWS); their fallback
    # is the bucket's
    shape_choices: dict[int, dict[str, str]] = field(default_factory=dict)
    # bucket → whether gate_up and SiLU·mul run as one AMX pass (AmxGemm.silu_mul) rather
    # than the bucket's GEMM, then SiLU·mul; a bucket without an entry fuses where it runs AMX
    silu_mul_fused: dict[int, bool] = field(default_factory=dict)
    packed: PackedOneDNN = field(default_factory=PackedOneDNN, repr=False)
    amx: AmxGemm = field(default_factory=AmxGemm, repr=False)
    quantized: QuantizedGemm = field(default_factory=QuantizedGemm, repr=False)
    # (rows, weight shape) → (backend, fallback), filled as they come; cleared when packings
    # change
    _routes: dict[tuple[int, torch.Size], tuple[Callable, Callable]] = field(
        default_factory=dict, init=False, repr=False
    )

    def __post_init__(self) -> None:
        named = {*self.choices.values(), *self.fallback_choices.values(), *self._shape_named()}
        unknown = named - set(BACKEND_NAMES)
        if unknown:
            raise ValueError(f"unknown CPU GEMM backend(s) {sorted(unknown)}: {BACKEND_NAMES}")
        partial = set(self.fallback_choices.values()) & set(PARTIAL_BACKENDS)
        if partial:
            raise ValueError(f"a fallback cannot be {sorted(partial)}: it may decline a weight")

    def prepare(
        self, weights: Sequence[torch.Tensor], silu_mul_weights: Sequence[torch.Tensor] = ()
    ) -> None:
        """Pack the weights now for the packed backends the plan uses (at start-up: else the
        first request would pay ~1 ms per weight), and drop the packings of those it does
        not (measuring left them). ``silu_mul_weights`` (among ``weights``) are packed for
        AMX too where the plan fuses SiLU·mul."""
        used = {*self.choices.values(), *self.fallback_choices.values(), *self._shape_named()}
        fused = any(self.silu_mul_fused.values())
        self.packed = self.packed if "onednn-packed" in used else PackedOneDNN()
        self.amx = self.amx if "amx" in used or fused else AmxGemm()
        self._routes.clear()  # they may name the packings dropped here
        for weight in weights:
            if "onednn-packed" in used:
                self.packed.pack(weight)
            if "amx" in used:
                self.amx.pack(weight)
        for weight in silu_mul_weights if fused else ():
            self.amx.pack(weight)

    def backend(self, name: str) -> Callable:
        if name == "gguf":
            raise ValueError("'gguf' runs through GemmPlan.gemm, which has its fallback")
        return {"onednn-packed": self.packed, "amx": self.amx}.get(name) or BACKENDS[name]

    def _shape_named(self) -> set[str]:
        return {name for shapes in self.shape_choices.values() for name in shapes.values()}

    def choice_for(
        self, rows: int, fallback: bool = False, shape: Sequence[int] | None = None
    ) -> str:
        """The backend for a GEMM of ``rows`` rows (on a weight of ``shape``, where given),
        or the one for the weights it declines (``fallback``: the bucket's)."""
        bucket = _bucket(rows)
        if shape is not None and not fallback:
            chosen = self.shape_choices.get(bucket, {}).get(shape_key(shape))
            if chosen is not None:
                return chosen
        choices = self.fallback_choices if fallback else self.choices
        chosen = choices.get(bucket) or self.choices.get(bucket, "torch")
        return "torch" if fallback and chosen in PARTIAL_BACKENDS else chosen

    def fuses_silu_mul(self, rows: int) -> bool:
        fused = self.silu_mul_fused.get(_bucket(rows))
        return self.choice_for(rows) == "amx" if fused is None else fused

    def gemm(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` through the plan's backend for x's row count."""
        key = (x.shape[0], weight.shape)
        route = self._routes.get(key)
        if route is None:  # once per row count and shape: a decode step makes ~120 calls
            route = self._routes[key] = self._route(*key)
        first, fallback = route
        out = first(x, weight, bias)
        return out if out is not None else fallback(x, weight, bias)

    def _route(self, rows: int, shape: Sequence[int]) -> tuple[Callable, Callable]:
        """The backend for ``rows`` on a weight of ``shape``, and the one for the weights it
        declines."""
        name = self.choice_for(rows, shape=shape)
        if name not in PARTIAL_BACKENDS:
            return self.backend(name), self.backend(name)
        partial = self.quantized if name == "gguf" else self.amx
        return partial, self.backend(self.choice_for(rows, fallback=True))

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        activation: str | None = None,
    ) -> torch.Tensor:
        """``x @ weight.T (+ bias)``, then silu(gate) * up for ``activation="silu_mul"``
        (one AMX pass where the plan measured it faster for these rows: [gate | up] never
        written out, the bits of the AMX GEMM then SiLU·mul); x is [rows, in]."""
        if activation == "silu_mul" and self.fuses_silu_mul(x.shape[0]):
            fused = self.amx.silu_mul(x, weight, bias)
            if fused is not None:
                return fused
        out = self.gemm(x, weight, bias)
        if activation is None:
            return out
        fused = silu_mul_native(out)  # bf16/fp16: one C pass
        if fused is not None:
            return fused
        gate, up = out.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    @classmethod
    def measure(
        cls,
        weights: Sequence[torch.Tensor],
        *,
        buckets: Sequence[int] = BUCKETS,
        cold_layers: int = 8,
        quantized: QuantizedGemm | None = None,
        silu_mul_weights: Sequence[torch.Tensor] = (),
    ) -> GemmPlan:
        """Time every available backend on ``weights`` (one layer's GEMM weights after
        another, as a forward reads them) at each bucket's row count; keep the fastest, and
        the fastest that takes every weight. "gguf" is timed where ``quantized`` holds every
        swept weight's blocks, "amx" where it takes every swept weight. Where AMX takes
        ``silu_mul_weights`` (the gate_up weights, whose output goes through SiLU·mul), the
        fused AMX pass is timed against the bucket's choice followed by SiLU·mul; where the
        fused pass wins, the bucket's backend is chosen again over the other shapes (gate_up's
        plain GEMM, about half a layer's time, runs only where the fused pass declines).

        Up to COLD_SWEEP_ROWS rows a GEMM still waits on its weights, so those row counts
        sweep every weight, read cold as in a forward; larger ones are compute-bound and
        sweep 1 / ``cold_layers`` of them, one weight shape at a time: a bucket's time for a
        backend is the sum of its shapes', and a shape goes to ``shape_choices`` where another
        backend beats the bucket's choice on it by SHAPE_MARGIN. Backends take turns within
        each repeat, so a burst of another tenant's work slows them alike."""
        plan = cls(quantized=quantized or QuantizedGemm())
        dtype = weights[0].dtype
        names = available_backends(dtype, torch.get_num_threads())
        sizes = sorted({w.shape[1] for w in weights})
        for rows in buckets:
            inputs = {k: torch.randn(rows, k).to(dtype) for k in sizes}
            cold = rows <= COLD_SWEEP_ROWS
            sweep = weights if cold else weights[: max(len(weights) // cold_layers, 4)]
            usable = plan._usable(names, sweep, inputs)
            complete = [name for name in usable if name not in PARTIAL_BACKENDS]
            if cold:
                timings = best_ms_each(plan._sweeps(usable, sweep, inputs))
                by_shape = {}
            else:
                by_shape = {
                    shape: best_ms_each(plan._sweeps(usable, group, inputs), LARGE_REPEATS)
                    for shape, group in _by_shape(sweep).items()
                }
                timings = _bucket_timings(by_shape, usable)
            plan._choose(rows, timings, by_shape, complete)
            silu_sweep = silu_mul_weights
            if not cold:
                silu_sweep = silu_mul_weights[: max(len(silu_mul_weights) // cold_layers, 2)]
            if (
                silu_sweep
                and plan.amx.silu_mul(inputs[silu_sweep[0].shape[1]], silu_sweep[0], None)
                is not None
            ):
                silu = best_ms_each(
                    {
                        "fused": lambda a=plan.amx, s=silu_sweep, x=inputs: _sweep(
                            a.silu_mul, s, x
                        ),
                        "apart": lambda p=plan, s=silu_sweep, x=inputs: _sweep(
                            lambda *a: silu_mul_native(p.gemm(*a)), s, x
                        ),
                    }
                )
                plan.silu_mul_fused[rows] = silu["fused"] < silu["apart"]
                fused_shape = shape_key(silu_sweep[0].shape)
                if plan.silu_mul_fused[rows] and len(by_shape) > 1 and fused_shape in by_shape:
                    # gate_up runs as the fused pass: its plain GEMM's time (the largest of
                    # a layer's) no longer decides the backend of the other shapes
                    others = {k: t for k, t in by_shape.items() if k != fused_shape}
                    plan._choose(rows, _bucket_timings(others, usable), by_shape, complete)
        return plan  # with the sweep's packings: they are the model's weights, packed

    def _choose(
        self,
        rows: int,
        timings: dict[str, float],
        by_shape: dict[str, dict[str, float]],
        complete: Sequence[str],
    ) -> None:
        """The bucket's backend by ``timings`` (and its fallback among ``complete``), and the
        shapes whose own fastest backend beats it."""
        self.timings_ms[rows] = timings
        self.choices[rows] = min(timings, key=timings.get)
        self.fallback_choices[rows] = min(complete, key=timings.get)
        sharing = self.choices[rows] == "amx" and amx_shares_rows(rows, torch.get_num_threads())
        margin = ROW_SHARING_MARGIN if sharing else SHAPE_MARGIN
        self.shape_choices[rows] = _own_choices(by_shape, self.choices[rows], margin)
        self._routes.clear()  # a route taken while measuring may name the old choice

    def _usable(
        self, names: Sequence[str], weights: Sequence[torch.Tensor], inputs: dict
    ) -> dict[str, Callable]:
        """Of ``names`` and the partial backends, those that take every one of ``weights``,
        by name (a backend that raises on them, e.g. oneDNN without this dtype, is left out)."""
        usable = {}
        for name in names:
            backend = self.backend(name)
            try:
                backend(inputs[weights[0].shape[1]], weights[0], None)
            except RuntimeError:
                continue
            usable[name] = backend
        if all(w in self.quantized.blocks for w in weights):
            usable["gguf"] = self.quantized
        if weights[0].dtype == torch.bfloat16 and all(AmxGemm.accepts(w) for w in weights):
            usable["amx"] = self.amx
        return usable

    @staticmethod
    def _sweeps(
        backends: dict[str, Callable], weights: Sequence[torch.Tensor], inputs: dict
    ) -> dict[str, Callable[[], None]]:
        return {
            name: lambda b=backend: _sweep(b, weights, inputs) for name, backend in backends.items()
        }

    def describe(self) -> str:
        parts = []
        for rows, name in sorted(self.choices.items()):
            shapes = self.shape_choices.get(rows, {})
            own = " ".join(f"{shape}:{shapes[shape]}" for shape in sorted(shapes))
            parts.append(f"{rows}:{name} ({own})" if own else f"{rows}:{name}")
        return ", ".join(parts)


def shape_key(shape: Sequence[int]) -> str:
    """A weight shape as shape_choices names it: "out x in"."""
    return "x".join(str(n) for n in shape)


# How much faster than the bucket's choice a shape's own fastest backend must be to take that
# shape: two backends within the noise of a few repeats' timing (oneDNN on plain and on packed
# weights, often) would otherwise split a bucket's shapes by chance.
SHAPE_MARGIN = 0.05
# Where the AMX GEMM shares a prompt's rows among the threads (amx_shares_rows), the margin
# another backend must beat it by to take a shape: the sweep times each GEMM alone, but in a
# forward AMX's rows land on the core whose RoPE, norm and next GEMM read them. Measured
# here (smollm2-135m, 1,676 tokens, 2 threads, five alternations): q/k/v and o on oneDNN,
# which the sweep had found 5-10% faster alone, made the prefill step 5% slower (308 against
# 291 ms median; the RoPE + KV store op 13.5-15 against 10-12 ms).
ROW_SHARING_MARGIN = 0.2
# Repeats of each shape's sweep above COLD_SWEEP_ROWS: three had named another backend for
# the q/k/v weights from one start-up to the next on this machine's noise (a few ms a sweep).
LARGE_REPEATS = 5


def _bucket_timings(
    by_shape: dict[str, dict[str, float]], backends: Sequence[str]
) -> dict[str, float]:
    """A bucket's time for each backend: the sum of its shapes'."""
    return {name: sum(t[name] for t in by_shape.values()) for name in backends}


def _own_choices(
    by_shape: dict[str, dict[str, float]], bucket_choice: str, margin: float = SHAPE_MARGIN
) -> dict[str, str]:
    """The shapes whose fastest backend beats the bucket's choice on them by ``margin``."""
    own = {}
    for shape, timings in by_shape.items():
        fastest = min(timings, key=timings.get)
        if timings[fastest] < (1 - margin) * timings[bucket_choice]:
            own[shape] = fastest
    return own


def _by_shape(weights: Sequence[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    groups: dict[str, list[torch.Tensor]] = {}
    for weight in weights:
        groups.setdefault(shape_key(weight.shape), []).append(weight)
    return groups


def _bucket(rows: int) -> int:
    """The bucket a row count routes to: the first at or above it, past the last the last."""
    for bucket in BUCKETS:
        if rows <= bucket:
            return bucket
    return BUCKETS[-1]


def plan_cache_dir() -> Path:
    return (
        Path(os.environ.get("PDCLUSTER_CACHE") or Path.home() / ".cache" / "pdcluster")
        / "gemm-plans"
    )


def cached_plan(
    weights: Sequence[torch.Tensor],
    directory: Path | None = None,
    quantized: QuantizedGemm | None = None,
    silu_mul_weights: Sequence[torch.Tensor] = (),
) -> GemmPlan:
    """The plan for these weights (and their GGUF blocks, if any; ``silu_mul_weights``, as
    ``GemmPlan.measure`` takes them) on this machine at the current thread count: read from
    the cache, or measured and stored."""
    quantized = quantized or QuantizedGemm()

    def measure() -> tuple[dict, GemmPlan]:
        plan = GemmPlan.measure(weights, quantized=quantized, silu_mul_weights=silu_mul_weights)
        data = {
            "choices": plan.choices,
            "fallback_choices": plan.fallback_choices,
            "shape_choices": plan.shape_choices,
            "silu_mul_fused": plan.silu_mul_fused,
            "timings_ms": plan.timings_ms,
        }
        return data, plan

    def parse(data: dict) -> GemmPlan:
        return GemmPlan(
            choices={int(k): v for k, v in data["choices"].items()},
            fallback_choices={int(k): v for k, v in data["fallback_choices"].items()},
            shape_choices={int(k): dict(v) for k, v in data["shape_choices"].items()},
            silu_mul_fused={int(k): bool(v) for k, v in data["silu_mul_fused"].items()},
            quantized=quantized,
        )

    key = _plan_key(weights, quantized, len(silu_mul_weights))
    path = (directory or plan_cache_dir()) / f"{key}.json"
    return cached_measurement(path, measure, parse)


def cached_measurement(
    path: Path, measure: Callable[[], tuple[dict, T]], parse: Callable[[dict], T]
) -> T:
    """``parse`` of the JSON stored at ``path``; where there is none (or it is unreadable),
    ``measure()``'s value, its JSON stored there first. Under a file lock beside ``path``,
    so that processes starting together on one machine measure once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return parse(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError):
            pass  # not measured yet here (or unreadable): measure now
        data, value = measure()
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps(data))
        os.replace(partial, path)
        return value


def _plan_key(weights: Sequence[torch.Tensor], quantized: QuantizedGemm, silu_mul: int) -> str:
    """What a plan depends on: the CPU, torch, our C kernels, the thread count, the
    weights' shapes and block types, how many of them go through SiLU·mul."""
    parts = [
        platform.machine(),
        cpu_signature(),  # its instruction sets too
        torch.__version__,
        f"kernels {cpu_native.source_digest()}",
        f"format {PLAN_FORMAT}",
        str(torch.get_num_threads()),
        str(weights[0].dtype),
        ",".join(f"{w.shape[0]}x{w.shape[1]}" for w in weights),
        f"silu_mul {silu_mul}",
        *([f"gguf {quantized.describe()}"] if quantized.blocks else []),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def cpu_signature() -> str:
    """What this CPU is, for keys of what is measured or built for it: the model name and the
    instruction sets. The name alone is not enough: VMs of one cloud report "AMD EPYC" with
    AVX2 on one host and AVX-512 BF16 on the next, and the cache may live on shared disk."""
    fields: dict[str, str] = {}  # the first processor's
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    model = fields.get("model name") or platform.processor()
    flags = hashlib.sha256(" ".join(sorted(fields.get("flags", "").split())).encode())
    capability = torch.backends.cpu.get_cpu_capability()
    # A forced level (engine.cpu_isa) runs other kernels on the same CPU: measured apart.
    level = os.environ.get(cpu_isa.VARIABLE, "native") or "native"
    return f"{model}|{capability}|flags {flags.hexdigest()[:12]}|isa {level}"


def _sweep(backend: Callable, weights: Sequence[torch.Tensor], inputs: dict) -> None:
    for weight in weights:
        backend(inputs[weight.shape[1]], weight, None)


def best_ms_each(runs: dict[str, Callable[[], object]], repeats: int = 3) -> dict[str, float]:
    """The fastest of ``repeats`` runs of each, in ms (after a warm-up each), the runs taking
    turns within a repeat."""
    for fn in runs.values():
        fn()
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


def best_ms(fn: Callable[[], object], repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def limit_blas_threads(threads: int) -> None:
    """OpenBLAS keeps its own thread pool: size it as torch's, so a worker given one core
    does not spread its GEMMs over two."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=threads, user_api="blas")
