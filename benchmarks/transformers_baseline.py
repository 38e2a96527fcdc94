"""transformers on the same weights and dtype as ``pdcluster bench engine``, run by it in a
process of its own: batched ``generate`` (what its users run offline) for decode, one forward
(``logits_to_keep=1``, as generate's prefill) for prefill. Prints one JSON line. Host memory
as our engine keeps it (engine.host_memory), unless ``--default-malloc``: the comparison is
of the two forwards, not of glibc's settings."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from benchmarks.engine_bench import _prompts, _shapes
from benchmarks.roofline import best_of
from engine.checkpoint import local_path
from engine.config import parse_dtype
from engine.host_memory import keep_freed_host_memory
from engine.tiny import TINY_NAME, save_tiny_checkpoint


class TransformersRunner:
    """transformers on the same weights and dtype: batched ``generate`` (what its users run
    offline), one forward (``logits_to_keep=1``, as generate's prefill) for prefill."""

    def __init__(self, model_source: str, dtype: torch.dtype, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self._tmp = None
        if model_source == TINY_NAME:
            self._tmp = tempfile.TemporaryDirectory()
            save_tiny_checkpoint(self._tmp.name)
            path = Path(self._tmp.name)
        else:
            path = local_path(model_source)
        kwargs = {"gguf_file": path.name} if path.is_file() else {}
        folder = path.parent if path.is_file() else path
        # Loaded in fp32, then cast: transformers keeps a GGUF's blocks packed (its own
        # dequantising kernels) when asked for another dtype, which is not the baseline.
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
        self.device = torch.device(device)
        self.model = model.to(dtype).to(self.device).eval()
        self.vocab = model.config.vocab_size
        self._seed = 10_000

    def fresh(self, count: int, length: int) -> torch.Tensor:
        self._seed += 1
        return torch.tensor(_prompts(count, length, self.vocab, self._seed), device=self.device)

    @torch.inference_mode()
    def prefill_s(self, count: int, length: int, repeats: int = 1) -> float:
        ids = self.fresh(count, length)
        return best_of(
            lambda: self.model(ids, use_cache=False, logits_to_keep=1),
            repeats=repeats,
            device=self.device,
        )

    @torch.inference_mode()
    def decode_step_s(self, count: int, length: int, new_tokens: int) -> float:
        ids = self.fresh(count, length)

        def generate() -> None:
            self.model.generate(
                ids,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )

        prefill = best_of(
            lambda: self.model(ids, use_cache=True, logits_to_keep=1), repeats=1, device=self.device
        )
        total = best_of(generate, repeats=1, device=self.device)
        return max(total - prefill, 1e-9) / (new_tokens - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--concurrency", required=True)
    parser.add_argument("--prompt-len", type=int, required=True)
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--prefill-repeats", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument(
        "--default-malloc", action="store_true", help="glibc's defaults, not the engine's"
    )
    args = parser.parse_args()
    if not args.default_malloc:
        keep_freed_host_memory()
    torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.dtype == "auto" else parse_dtype(args.dtype)
    runner = TransformersRunner(args.model, dtype, args.device)
    decode = [
        runner.decode_step_s(int(c), args.prompt_len, args.output_len) * 1e3
        for c in args.concurrency.split(",")
    ]
    prefill = [runner.prefill_s(c, n, args.prefill_repeats) * 1e3 for c, n in _shapes(args.prefill)]
    print(json.dumps({"decode_ms": decode, "prefill_ms": prefill}))


if __name__ == "__main__":
    main()
