"""CUDA IPC weight sharing between two processes on one GPU (colocated trainer and engine).

The "trainer" process makes ~1B bf16 Llama-shaped HF tensors on cuda:0, shares them in 512 MiB buckets
(:func:`vime_core.weight_sync.ipc.share_weights`); the "engine" process maps them with
:func:`vime_core.weight_sync.ipc.open_shared_weights`, copies each into its own parameter tensor (what a reload
does) and checks it bit for bit against the same tensors regenerated from the same seed. Prints bytes, seconds
(share, open + copy) and whether every tensor matched.

    PYTHONPATH=. python3 bench/ipc_weight_sync.py
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

SHAPES = [("model.embed_tokens.weight", (32000, 2048)), ("lm_head.weight", (32000, 2048))] + [
    (f"model.layers.{i}.{n}", s)
    for i in range(16)
    for n, s in (
        ("self_attn.q_proj.weight", (2048, 2048)),
        ("self_attn.k_proj.weight", (2048, 2048)),
        ("self_attn.v_proj.weight", (2048, 2048)),
        ("self_attn.o_proj.weight", (2048, 2048)),
        ("mlp.gate_proj.weight", (5632, 2048)),
        ("mlp.up_proj.weight", (5632, 2048)),
        ("mlp.down_proj.weight", (2048, 5632)),
    )
]


def make_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return {n: torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) for n, s in SHAPES}


def engine(conn) -> None:
    from vime_core.weight_sync.ipc import open_shared_weights

    torch.cuda.set_device(0)
    params = {n: torch.empty(s, device="cuda", dtype=torch.bfloat16) for n, s in SHAPES}  # the engine's weights
    reference = make_tensors()
    conn.send("ready")
    payload = conn.recv()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 0
    for name, t in open_shared_weights(payload):
        params[name].copy_(t)
        n += 1
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    equal = sum(torch.equal(params[k], reference[k]) for k in reference)
    conn.send({"tensors": n, "equal": equal, "open_copy_seconds": seconds})
    conn.recv()  # the trainer keeps its buffers alive until here


def main() -> None:
    from vime_core.weight_sync.ipc import share_weights

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=engine, args=(child,))
    proc.start()
    torch.cuda.set_device(0)
    tensors = make_tensors()
    assert parent.recv() == "ready"
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    buffers, payload = share_weights(tensors.items(), bucket_bytes=512 << 20)
    torch.cuda.synchronize()
    share_s = time.perf_counter() - t0
    parent.send(payload)
    got = parent.recv()
    parent.send("done")
    proc.join(timeout=60)
    nbytes = sum(b.numel() for b in buffers)
    res = {
        "bytes": nbytes,
        "buckets": len(buffers),
        "share_seconds": share_s,
        **got,
        "bit_exact": got["equal"] == len(tensors),
        "copy_GB_per_s": nbytes / got["open_copy_seconds"] / 1e9,
    }
    print("RESULT " + json.dumps(res), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "ipc.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
