"""The engine's command-line options, shared by `specdec generate`, `specdec serve` and `specdec draft serve`:
add_engine_args puts them on a parser, engine_kwargs turns parsed ones into LLM / Engine keyword arguments."""

from __future__ import annotations

import argparse


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (GPU default), float16")
    parser.add_argument("--kv-cache-tokens", type=int, default=None,
                        help="KV cache size in tokens (default: from free GPU memory, or 32k on CPU)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--admission-batch", type=int, default=None,
                        help="while requests decode, admit queued ones once this many slots are free (coalescing "
                             "eager prefill steps; default: sized from measured step costs, 1 on CPU)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + output in tokens (default: the model's max_position_embeddings); "
                             "also bounds the CUDA-graph shapes captured at start-up")
    parser.add_argument("--twin", default=None,
                        help="run the model as a scaled twin of a larger shape (qwen3-8b, qwen3-1.7b, qwen3-0.6b; "
                             "qwen3.5-27b for a Qwen3.5 model)")
    parser.add_argument("--piecewise-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="on a GPU, replay all but attention of eager (prefill / mixed) steps as CUDA graphs "
                             "(default: on with CUDA graphs, off with tensor parallelism)")
    parser.add_argument("--fixed-acceptance", action=argparse.BooleanOptionalAction, default=None,
                        help="accept decode / verify steps on their fixed shape, as CUDA graphs on a GPU (default: on)")
    parser.add_argument("--overlap-steps", action=argparse.BooleanOptionalAction, default=None,
                        help="schedule and launch each plain decode step while the one before it still runs on the "
                             "device, fed its tokens from there (needs static shapes and fixed acceptance, and a "
                             "model that is not hybrid; default: on where those hold)")
    parser.add_argument("--column-major-weights", action=argparse.BooleanOptionalAction, default=None,
                        help="store projection weights column-major, for cuBLAS's faster decode GEMMs (default: on "
                             "a GPU with the fused kernels)")
    parser.add_argument("--no-fused-kernels", action="store_true",
                        help="on a GPU, run the plain PyTorch elementwise kernels instead of compiled fused ones")
    parser.add_argument("--attention-backend", choices=("sdpa", "triton"), default=None,
                        help="attention of decode / verify steps: 'triton' (the default on a GPU) reads the paged "
                             "KV cache in a kernel, 'sdpa' (the default elsewhere) gathers it for PyTorch's SDPA")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="split the model over N GPUs; launch with torchrun --nproc-per-node N")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(device=args.device, dtype=args.dtype, kv_cache_tokens=args.kv_cache_tokens,
                block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, twin=args.twin,
                admission_batch=getattr(args, "admission_batch", None),
                piecewise_graphs=getattr(args, "piecewise_graphs", None),
                fixed_acceptance=getattr(args, "fixed_acceptance", None),
                overlap_steps=getattr(args, "overlap_steps", None),
                max_model_len=getattr(args, "max_model_len", None),
                fused_kernels=False if getattr(args, "no_fused_kernels", False) else None,
                column_major_weights=getattr(args, "column_major_weights", None),
                attention_backend=getattr(args, "attention_backend", None),
                tensor_parallel_size=getattr(args, "tensor_parallel_size", 1))
