"""``pdcluster bench kernels``: every Triton kernel on CUDA, checked against its torch
reference and timed next to the torch / cuBLAS / SDPA equivalent in the same run, plus an
8k-token prefill of a Llama-3-8B-shaped model (random weights) and its MFU.

Shapes are Llama-3-8B's (hidden 4096, 32 q heads / 8 kv heads, head_dim 128, FFN 14336)
and a GQA-8 70B layer's (hidden 8192, 64 q heads / 8 kv heads, FFN 28672), bf16.
Prints one table; built to finish in a few minutes on one H200.

``--smoke`` runs the same code paths at toy shapes on the CPU in Triton's interpreter
(``TRITON_INTERPRET=1``): it checks the script itself, not the GPU (the timings are
meaningless there).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict

from benchmarks.kernel_rows import Row, check_close, format_table, time_call

H200_BF16_TFLOPS = 989.0  # dense
H200_HBM_GBPS = 4800.0


class KernelBench:
    def __init__(self, smoke: bool) -> None:
        import torch

        self.torch = torch
        self.smoke = smoke
        self.device = torch.device("cpu" if smoke else "cuda")
        self.dtype = (
            torch.float16 if smoke else torch.bfloat16
        )  # the interpreter's bf16 is unreliable
        self.rows: list[Row] = []
        self.iters = 1 if smoke else 10
        torch.manual_seed(0)

    def randn(self, *shape, scale: float = 1.0):
        return (
            self.torch.randn(*shape, device=self.device, dtype=self.torch.float32)
            .mul_(scale)
            .to(self.dtype)
        )

    # ---- prefill attention -------------------------------------------------------------
    def prefill_attention(self) -> None:
        from engine.kernels.prefill_attention import (
            prefill_attention_reference,
            prefill_attention_triton,
        )

        torch = self.torch
        hq, hkv, d = (4, 1, 64) if self.smoke else (32, 8, 128)
        cases = [(2, 40)] if self.smoke else [(8, 2048), (2, 8192), (1, 16384)]
        for batch, seq in cases:
            total = batch * seq
            q, k, v = self.randn(total, hq, d), self.randn(total, hkv, d), self.randn(total, hkv, d)
            cu = torch.arange(0, total + 1, seq, device=self.device, dtype=torch.int32)
            prefix = torch.zeros(batch, device=self.device, dtype=torch.int32)
            cache = torch.zeros(1, 16, hkv, d, device=self.device, dtype=self.dtype)
            tables = torch.zeros(batch, 1, device=self.device, dtype=torch.int32)
            scale = d**-0.5
            args = (q, k, v, cu, prefix, cache, cache, None, None, tables, scale, seq)
            out = prefill_attention_triton(*args)
            check = "-"
            if self.smoke or seq <= 8192:
                ref = (
                    prefill_attention_reference(*args)
                    if self.smoke
                    else self._sdpa_prefill(q, k, v, batch, seq, scale)
                )
                check = check_close("prefill", out, ref, 2e-2, 2e-2)
            flops = 4 * batch * hq * d * seq * (seq + 1) / 2  # causal: each score once
            ours = (
                flops
                / time_call(lambda: prefill_attention_triton(*args), self.device, iters=self.iters)
                / 1e12
            )
            base = (
                flops
                / time_call(
                    lambda: self._sdpa_prefill(q, k, v, batch, seq, scale),
                    self.device,
                    iters=self.iters,
                )
                / 1e12
            )
            self.rows.append(
                Row(
                    "prefill attn (causal)",
                    f"{batch}x{seq} H{hq}/{hkv} D{d}",
                    check,
                    ours,
                    base,
                    "TFLOP/s",
                    ">=0.9x SDPA flash at 8k-16k",
                )
            )

    def _sdpa_prefill(self, q, k, v, batch, seq, scale):
        torch = self.torch
        hq, hkv = q.shape[1], k.shape[1]
        qb = q.view(batch, seq, hq, -1).transpose(1, 2)
        kb = k.view(batch, seq, hkv, -1).transpose(1, 2)
        vb = v.view(batch, seq, hkv, -1).transpose(1, 2)
        if self.device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = torch.nn.functional.scaled_dot_product_attention(
                    qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True
                )
        else:
            out = torch.nn.functional.scaled_dot_product_attention(
                qb.float(), kb.float(), vb.float(), is_causal=True, scale=scale, enable_gqa=True
            ).to(q.dtype)
        return out.transpose(1, 2).reshape(batch * seq, hq, -1)

    # ---- fused GEMMs -------------------------------------------------------------------
    def gemms(self) -> None:
        from engine.kernels.fused_linear import fused_linear_reference, fused_linear_triton

        torch = self.torch
        shapes = [
            ("qkv 8B", 4096, 6144, None),
            ("gate_up 8B", 4096, 2 * 14336, "silu_mul"),
            ("qkv 70B", 8192, 10240, None),
            ("gate_up 70B", 8192, 2 * 28672, "silu_mul"),
        ]
        ms = [512, 2048, 8192, 16384]
        if self.smoke:
            shapes, ms = [("qkv", 64, 96, None), ("gate_up", 64, 128, "silu_mul")], [33]
        for name, k_dim, n_dim, act in shapes:
            w = self.randn(n_dim, k_dim, scale=k_dim**-0.5)
            for m in ms:
                if not self.smoke and "70B" in name and m > 8192:
                    continue
                x = self.randn(m, k_dim)
                out = fused_linear_triton(x, w, None, act)
                check = check_close(name, out, fused_linear_reference(x, w, None, act), 3e-2, 3e-2)
                flops = 2 * m * k_dim * n_dim
                ours = (
                    flops
                    / time_call(
                        lambda: fused_linear_triton(x, w, None, act), self.device, iters=self.iters
                    )
                    / 1e12
                )

                def baseline():
                    y = torch.matmul(x, w.t())
                    if act == "silu_mul":
                        gate, up = y.chunk(2, dim=-1)
                        y = torch.nn.functional.silu(gate) * up
                    return y

                base = flops / time_call(baseline, self.device, iters=self.iters) / 1e12
                self.rows.append(
                    Row(
                        f"GEMM {name}",
                        f"M={m} K={k_dim} N={n_dim}",
                        check,
                        ours,
                        base,
                        "TFLOP/s",
                        ">=0.9x torch.matmul",
                    )
                )

    # ---- paged decode ------------------------------------------------------------------
    def decode(self) -> None:
        from engine.kernels.decode_attention import (
            decode_attention_reference,
            decode_attention_triton,
        )
        from engine.kernels.kv_codec import quantize_kv_blocks

        torch = self.torch
        hq, hkv, d, bs = (4, 1, 64, 16) if self.smoke else (32, 8, 128, 16)
        cases = (
            [(3, 50)]
            if self.smoke
            else [
                (1, 1024),
                (1, 32768),
                (16, 8192),
                (64, 4096),
                (64, 32768),
                (256, 1024),
                (256, 4096),
            ]
        )
        for kv_kind in ("bf16", "fp8"):
            for batch, ctx in cases:
                pages = math.ceil(ctx / bs)
                blocks = batch * pages
                k_cache = self.randn(blocks, bs, hkv, d)
                v_cache = self.randn(blocks, bs, hkv, d)
                k_scale = v_scale = None
                if kv_kind == "fp8":
                    k_cache, k_scale = quantize_kv_blocks(k_cache)
                    v_cache, v_scale = quantize_kv_blocks(v_cache)
                perm = torch.randperm(blocks, device=self.device).to(torch.int32)
                tables = perm.view(batch, pages)
                lens = torch.full((batch,), ctx, device=self.device, dtype=torch.int32)
                q = self.randn(batch, hq, d)
                args = (q, k_cache, v_cache, k_scale, v_scale, tables, lens, d**-0.5)
                out = decode_attention_triton(*args, max_context_len=ctx)
                check = "-"
                if self.smoke or batch * ctx <= 64 * 4096:
                    check = check_close(
                        "decode",
                        out,
                        decode_attention_reference(*args, max_context_len=ctx),
                        2e-2,
                        2e-2,
                    )
                kv_bytes = 2 * batch * ctx * hkv * d * k_cache.element_size()
                seconds = time_call(
                    lambda: decode_attention_triton(*args, max_context_len=ctx),
                    self.device,
                    iters=self.iters,
                )
                self.rows.append(
                    Row(
                        f"paged decode ({kv_kind} pages)",
                        f"B={batch} ctx={ctx}",
                        check,
                        kv_bytes / seconds / 1e9,
                        H200_HBM_GBPS,
                        "GB/s",
                        ">=60% of HBM at B=64 ctx=4k",
                    )
                )
                del k_cache, v_cache

    # ---- fp8 KV quantise + packing -------------------------------------------------------
    def kv_packing(self) -> None:
        from engine.kernels.kv_codec import quantize_kv_blocks_reference, quantize_kv_blocks_triton
        from kv_transfer.codec import encode_layer

        hkv, d, bs = (1, 64, 16) if self.smoke else (8, 128, 16)
        for tokens in [64] if self.smoke else [1024, 8192, 32768]:
            n = tokens // bs
            k, v = self.randn(n, bs, hkv, d), self.randn(n, bs, hkv, d)
            q, s = quantize_kv_blocks_triton(k)
            # The reference on the CPU: its e4m3 cast rounds once (see test_kv_codec).
            q_ref, s_ref = quantize_kv_blocks_reference(k.cpu())
            q, s = q.cpu(), s.cpu()
            check = check_close(
                "quant",
                q.float() * s[:, None, :, None],
                q_ref.float() * s_ref[:, None, :, None],
                0,
                0.07,
            )
            in_bytes = 2 * k.numel() * k.element_size()
            seconds = time_call(
                lambda: encode_layer(k, v, wire_dtype="fp8", num_tokens=tokens),
                self.device,
                iters=self.iters,
            )
            self.rows.append(
                Row(
                    "fp8 KV quantise + pack to host",
                    f"{tokens} tok, 1 layer",
                    check,
                    in_bytes / seconds / 1e9,
                    None,
                    "GB/s (bf16 in)",
                )
            )

    # ---- whole-model prefill ----------------------------------------------------------------
    def model_prefill(self) -> None:
        import torch

        from engine.attention_metadata import build_metadata
        from engine.config import ModelConfig, RopeConfig
        from engine.kv_cache import PagedKVCache
        from engine.model import LlamaModel

        if self.smoke:
            config = ModelConfig(
                "llama", 256, 64, 128, 2, 4, 1, 64, 256, rope=RopeConfig(theta=500000.0)
            )
            tokens = 48
        else:
            config = ModelConfig(
                "llama",
                128256,
                4096,
                14336,
                32,
                32,
                8,
                128,
                131072,
                rope=RopeConfig(theta=500000.0),
            )
            tokens = 8192
        with torch.device(self.device):
            model = LlamaModel(config, tokens + 16).to(self.dtype)
        model.rotary.float()
        for name, p in model.named_parameters():
            if "norm" in name:
                p.data.fill_(1.0)
            else:
                p.data.normal_(0, 0.02)
        bs = 16
        cache = PagedKVCache(config, math.ceil(tokens / bs), bs, self.dtype, self.device)
        meta = build_metadata(
            slots=torch.arange(tokens),
            decode_tables=[],
            decode_context_lens=[],
            prefill_tables=[list(range(cache.num_blocks))],
            prefill_new_lens=[tokens],
            prefill_prefix_lens=[0],
            block_size=bs,
            fp8=False,
            device=torch.device(self.device),
        )
        ids = torch.randint(0, config.vocab_size, (tokens,), device=self.device)
        pos = torch.arange(tokens, device=self.device)
        run = lambda: model.compute_logits(model(ids, pos, meta, cache)[-1:])
        seconds = time_call(run, self.device, warmup=2, iters=1 if self.smoke else 5)
        c = config
        per_token = (
            2
            * c.num_layers
            * (
                c.hidden_size * c.qkv_size
                + c.q_size * c.hidden_size
                + 3 * c.hidden_size * c.intermediate_size
            )
        )
        attention = 4 * c.num_layers * c.num_heads * c.head_dim * tokens * (tokens + 1) / 2
        flops = per_token * tokens + attention
        tflops = flops / seconds / 1e12
        mfu = tflops / H200_BF16_TFLOPS
        self.rows.append(
            Row(
                "Llama-3-8B prefill (model)",
                f"{tokens} tokens",
                "-",
                tflops,
                H200_BF16_TFLOPS,
                "TFLOP/s",
                f">=50% MFU (got {mfu:.0%}, {seconds * 1e3:.0f} ms)",
            )
        )

    def run(self, parts: list[str]) -> list[Row]:
        for part in parts:
            start = time.perf_counter()
            getattr(self, part)()
            print(
                f"[{part} done in {time.perf_counter() - start:.1f}s]", file=sys.stderr, flush=True
            )
        return self.rows


PARTS = ["prefill_attention", "gemms", "decode", "kv_packing", "model_prefill"]


def add_kernels_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "kernels", help="Triton kernels on CUDA: correctness + speed vs torch/cuBLAS/SDPA"
    )
    p.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}"
    )
    p.add_argument(
        "--smoke", action="store_true", help="toy shapes on the CPU in Triton's interpreter"
    )
    p.add_argument("--json-out")
    p.set_defaults(func=run_kernels_cli)


def run_kernels_cli(args) -> int:
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import
        os.environ["PDCLUSTER_FORCE_TRITON"] = "1"  # the model forward runs the kernels too
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print(
            "error: bench kernels needs a CUDA GPU (or --smoke to check the script on CPU)",
            file=sys.stderr,
        )
        return 2
    rows = KernelBench(args.smoke).run([p for p in args.parts.split(",") if p])
    if not args.smoke:
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(format_table(rows))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([{**asdict(r), "ratio": r.ratio} for r in rows], f, indent=2)
    return 1 if any(r.check.startswith("FAIL") for r in rows) else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_kernels_parser(parser.add_subparsers(dest="bench", required=True))
    sys.exit(run_kernels_cli(parser.parse_args(["kernels", *sys.argv[1:]])))
