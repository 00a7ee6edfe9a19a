"""Running a test function on 2 CPU processes (gloo), and the tiny decoders and per-rank batches those tests train.

`run_ranks(fn, *args)` runs `fn(rank, world_size, *args)` in `world_size` spawned processes, each with the default
process group initialised (gloo, 127.0.0.1, a free port) and destroyed at the end, and returns the ranks' return
values in rank order (anything torch.save can write: state dicts of CPU tensors, numbers). An exception in a rank is
raised in the caller with that rank's traceback. `fn` and its arguments must be picklable: a top-level function of an
importable module, plain data.

Everything here is importable in a spawned process (top-level functions only); `transformers` is imported when a
model is built. TORCH_DISTRIBUTED_DEBUG is never set: its DETAIL level segfaults here even for plain DDP.
"""
from __future__ import annotations

import datetime
import functools
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

SEQ = 32
VOCAB = 128
BATCH = 4


# ---------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, timeout_s: float,
               args: tuple) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)  # 2 ranks on 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def run_ranks(fn: Callable, *args, world_size: int = 2, timeout_s: float = 120) -> list:
    """`fn(rank, world_size, *args)` on `world_size` spawned processes (see the module docstring); the ranks' return
    values in rank order. Raises torch.multiprocessing's ProcessRaisedException (with the rank's traceback) when a
    rank raises, ProcessExitedException when one dies, TimeoutError after `timeout_s` seconds (the ranks killed)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="ranks-") as out_dir:
        ctx = mp.start_processes(_rank_main, args=(fn, world_size, free_port(), out_dir, timeout_s, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not finish on {world_size} ranks in "
                                       f"{timeout_s} s")
        finally:
            for p in ctx.processes:  # only on a timeout or a failure: the others are still waiting on it
                if p.is_alive():
                    p.terminate()
                    p.join(5)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


# ---------------------------------------------------------------------------------------------
# models and data
# ---------------------------------------------------------------------------------------------
def tiny_decoder(arch: str = "gpt2", *, dropout: float = 0.0, layers: int = 2, width: int = 32, seed: int = 0):
    """A randomly initialised decoder LM (transformers), in train mode, with weights drawn under `seed`:
    "gpt2" (GPT2LMHeadModel; `dropout` on the embeddings, attention and residuals) or "llama" (LlamaForCausalLM;
    `dropout` on the attention weights). Sequence up to SEQ, vocabulary VOCAB, 2 heads."""
    import transformers as T

    if arch == "gpt2":
        cls, cfg = T.GPT2LMHeadModel, T.GPT2Config(
            n_layer=layers, n_embd=width, n_head=2, n_positions=SEQ, vocab_size=VOCAB, bos_token_id=0,
            eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    elif arch == "llama":
        cls, cfg = T.LlamaForCausalLM, T.LlamaConfig(
            num_hidden_layers=layers, hidden_size=width, num_attention_heads=2, num_key_value_heads=2,
            intermediate_size=2 * width, vocab_size=VOCAB, max_position_embeddings=SEQ, attention_dropout=dropout)
    else:
        raise ValueError(f"unknown arch {arch!r}: gpt2 or llama")
    cfg.use_cache = False
    torch.manual_seed(seed)
    return cls(cfg).train()


def rank_batch(rank: int, step: int = 0, *, batch: int = BATCH, seq: int = SEQ) -> dict:
    """The keyword batch of `rank` at `step` (different data per rank and step, the same shapes): input_ids,
    labels (-100 on padding) and an attention_mask whose row 1 is padded (its last quarter) and, with batch > 2,
    row 2 too (its last 5 tokens)."""
    gen = torch.Generator().manual_seed(1000 * (rank + 1) + step)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if batch > 1:
        mask[1, 3 * seq // 4:] = 0
    if batch > 2:
        mask[2, -5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "use_cache": False}


def block_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks (planner.core.candidates.repeated_blocks), in order."""
    from capture.module_tags import repeated_blocks

    return [model.get_submodule(n) for n in repeated_blocks(model)]


def _checkpointed_forward(block: torch.nn.Module, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(type(block).forward.__get__(block), *args, use_reentrant=False, **kwargs)


def checkpoint_blocks_in_place(model: torch.nn.Module) -> torch.nn.Module:
    """Per-block checkpointing applied in place: each repeated block's forward becomes an instance attribute that
    runs the class's forward (read at call time, so FSDP2's unsharded parameters are used) under
    torch.utils.checkpoint (non-reentrant, RNG state preserved). The block's hooks still run around it; the model
    keeps its class. Returns the model."""
    for block in block_modules(model):
        if "forward" in block.__dict__:
            raise ValueError(f"{type(block).__name__} already has a forward of its own")
        block.forward = functools.partial(_checkpointed_forward, block)
    return model


def uncheckpoint_blocks(model: torch.nn.Module) -> None:
    """Undo checkpoint_blocks_in_place."""
    for block in block_modules(model):
        block.__dict__.pop("forward", None)


def cpu_state(model: torch.nn.Module) -> dict:
    """The parameters as full CPU tensors by name (DTensors gathered), detached copies."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().cpu().clone()
    return out
