"""Train torchtitan's Llama3 debugmodel with FSDP2 + context parallelism (cp_compile), then the same
model in one process, and compare: loss per step, tokens/s, peak memory per rank.

    python examples/titan_cp.py                      # 2 local gloo ranks on CPU, 512 tokens, ~1 minute
    python examples/titan_cp.py --seq 8192 --steps 3 # long sequence (several minutes on 2 CPU cores)
    torchrun --nproc-per-node 4 examples/titan_cp.py --cp 2 --dp-shard 2 --seq 32768   # GPUs: NCCL

What is applied is what torchtitan's ``parallelize_llama`` applies, with the CP backend where
torchtitan's compile backend goes: selective activation checkpointing on every block, each block
compiled with ``plan.backend()`` (fullgraph=True), FSDP2 over the mesh dimension that data parallel
shards and CP share ("fsdp" = dp_shard x cp). The batch is packed documents with
``attn_backend="varlen"``: every rank holds its slots of every document (``plan.shard(..., cu_seqlens=)``),
the positions of its slots inside their documents (``plan.positions(cu_seqlens=)``), and torchtitan's
VarlenMetadata of the *global* documents. Labels of padding slots are ignored.

The loss is a sum over this rank's tokens divided by the global token count, so its sum over all
ranks is the one-process mean: FSDP2 must sum gradients (divide factor 1), as torchtitan does.

varlen_attn has no CPU kernel: the CP model runs on CPU because the backend replaces it with
cp_compile's packed attention; the one-process CPU run uses per-document SDPA instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

MiB = 2**20


def build_model(layers: int, seq: int, attn: str, device: torch.device):
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel"](attn_backend=attn)
    config.layers = config.layers[:layers]
    for layer in config.layers:  # what torchtitan's trainer does for training.seq_len
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    model.init_states(buffer_device=device)
    return model


def document_lengths(seq: int, seed: int) -> list[int]:
    """Random document lengths that fill ``seq`` tokens (a packed batch)."""
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], seq
    while left > 0:
        n = min(left, int(torch.randint(max(1, seq // 16), max(2, seq // 2), (1,), generator=g)))
        lengths.append(n)
        left -= n
    return lengths


def batch(step: int, dp_index: int, seq: int, vocab: int):
    """Tokens [1, S], labels, per-document positions and torchtitan's VarlenMetadata (global)."""
    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    seed = 1000 * step + dp_index
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (1, seq + 1), generator=g)
    positions = torch.cat([torch.arange(n) for n in document_lengths(seq, seed)]).unsqueeze(0)
    return tokens[:, :-1], tokens[:, 1:], positions, create_varlen_metadata_for_document(positions)


def cp_varlen_metadata(varlen_meta, seq: int, device):
    """torchtitan's VarlenMetadata as the CP blocks take it: the global documents, and max_q/max_k as
    the token budget. The maxima are kernel hints CP does not read, but a compiled block guards on the
    ints it is given: the batch's own maxima would compile the blocks again whenever they change."""
    cu = varlen_meta.cu_seq_q.to(device)
    return varlen_meta._replace(cu_seq_q=cu, cu_seq_k=cu, max_q=seq, max_k=seq)


def summed_loss(logits, labels, n_tokens):
    return (
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=-100) / n_tokens
    )


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cp_rank(args) -> dict:
    """Runs on every rank: FSDP2 + CP training; returns this rank's losses, step times and peak memory."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    import cp_compile
    from cp_compile.tools.memory import PeakMemory

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    world = dist.get_world_size()
    if world != args.dp_shard * args.cp:
        raise SystemExit(f"world size {world} != dp_shard {args.dp_shard} x cp {args.cp}")
    mesh = init_device_mesh(device.type, (args.dp_shard, args.cp), mesh_dim_names=("dp_shard", "cp"))
    fsdp_mesh = mesh["dp_shard", "cp"]._flatten("fsdp")  # torchtitan's "fsdp" dimension: dp_shard x cp
    plan = cp_compile.ContextParallel(mesh["cp"])
    dp_index = mesh.get_local_rank("dp_shard")
    rank0 = dist.get_rank() == 0

    model = build_model(args.layers, args.seq, "varlen", device)
    SelectiveAC(SelectiveAC.Config()).apply(model)  # torchtitan's SAC; CP outputs are saved by the backend
    backend = plan.backend(args.inner)
    for block in model.layers.values():
        block.compile(backend=backend, fullgraph=True)
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # the loss is a sum over ranks
            if device.type == "cpu":
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    vocab = model.config.vocab_size
    n_tokens = args.seq * args.dp_shard  # global tokens per step

    losses, times, compiled, peak = [], [], [], 0
    for step in range(args.steps):
        graphs = len(backend.records)
        inputs, labels, positions, varlen_meta = batch(step, dp_index, args.seq, vocab)
        cu = varlen_meta.cu_seq_q
        real = cp_compile.layout.packed.packed_slots(cu, plan.rank, plan.world_size)["real"]
        local_inputs = plan.shard(inputs[0], 0, cu_seqlens=cu).unsqueeze(0).to(device)
        local_labels = plan.shard(labels[0], 0, cu_seqlens=cu).masked_fill(~real, -100).unsqueeze(0).to(device)
        local_positions = plan.positions(cu_seqlens=cu).unsqueeze(0).to(device)
        varlen_meta = cp_varlen_metadata(varlen_meta, args.seq, device)
        dist.barrier()
        start = time.perf_counter()
        with PeakMemory(device) as mem, plan:
            loss = summed_loss(model(local_inputs, local_positions, varlen_meta), local_labels, n_tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            sync(device)
        times.append(time.perf_counter() - start)
        # the first new slot count compiles the blocks again, with dynamic sizes; then nothing compiles
        compiled.append(len(backend.records) > graphs)
        if not compiled[-1]:
            peak = max(peak, mem.peak_bytes)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
        if rank0:
            print(
                f"  CP step {step}: loss {losses[-1]:.6f}, {times[-1]:.2f} s"
                f"{' (compiles)' if compiled[-1] else ''}, {local_inputs.shape[1]} local slots per rank",
                flush=True,
            )
    report = str(backend.explain()) if rank0 and args.explain else ""
    steady = [t for t, c in zip(times, compiled) if not c] or times
    return {"losses": losses, "times": times, "steady": steady, "peak": peak, "report": report}


def one_process(args, device: torch.device) -> dict:
    """The same model, data and optimizer in this process alone (the dp_shard batches summed)."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.common import attention as titan_attention

    from cp_compile.tools.memory import PeakMemory

    model = build_model(args.layers, args.seq, "varlen", device)
    SelectiveAC(SelectiveAC.Config()).apply(model)
    if device.type == "cpu":  # no CPU varlen kernel: each document through SDPA
        titan_attention.varlen_attn = per_document_varlen
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    n_tokens = args.seq * args.dp_shard
    losses, times, peak = [], [], 0
    for step in range(args.steps):
        start = time.perf_counter()
        with PeakMemory(device) as mem:
            total = 0.0
            for dp_index in range(args.dp_shard):
                inputs, labels, positions, meta = (
                    t.to(device) if torch.is_tensor(t) else t
                    for t in batch(step, dp_index, args.seq, model.config.vocab_size)
                )
                meta = meta._replace(cu_seq_q=meta.cu_seq_q.to(device), cu_seq_k=meta.cu_seq_k.to(device))
                loss = summed_loss(model(inputs, positions, meta), labels, n_tokens)
                loss.backward()
                total += loss.item()
            optimizer.step()
            optimizer.zero_grad()
            sync(device)
        times.append(time.perf_counter() - start)
        if step > 0:
            peak = max(peak, mem.peak_bytes)
        losses.append(total)
        print(f"  one process step {step}: loss {total:.6f}, {times[-1]:.2f} s", flush=True)
    return {"losses": losses, "times": times, "peak": peak}


def per_document_varlen(
    q,
    k,
    v,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    num_splits=None,
    return_aux=None,
    **unused,
):
    """varlen_attn for one CPU process: each document on its own through SDPA."""
    bounds = cu_seq_q.tolist()
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        tq, tk, tv = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        outs.append(
            F.scaled_dot_product_attention(
                tq, tk, tv, is_causal=tuple(window_size) == (-1, 0), scale=scale, enable_gqa=enable_gqa
            )[0].transpose(0, 1)
        )
    return torch.cat(outs)


def median_after_first(times: list[float]) -> float:
    return statistics.median(times[1:] if len(times) > 1 else times)


def summary(args, cp: list[dict], single: dict | None) -> None:
    tokens = args.seq * args.dp_shard
    cp_time = statistics.median(max(r["steady"][i] for r in cp) for i in range(len(cp[0]["steady"])))
    print(
        f"\nllama3 debugmodel ({args.layers} layers), {args.seq} tokens per sequence x dp_shard {args.dp_shard}, "
        f"CP {args.cp}, {args.steps} steps (CP: median of the {len(cp[0]['steady'])} steps that compiled nothing; "
        f"one process, eager: median after step 0)"
    )
    if single is not None:
        print("step  loss (FSDP2 + CP)  loss (one process)  diff")
        for i, (a, b) in enumerate(zip(cp[0]["losses"], single["losses"])):
            print(f"{i:4d}  {a:17.6f}  {b:18.6f}  {abs(a - b):.2e}")
    print(
        f"FSDP2 + CP: {tokens / cp_time:9.0f} tokens/s ({cp_time:.2f} s per step); peak memory per rank "
        + ", ".join(f"{r['peak'] / MiB:.0f} MiB" for r in cp)
    )
    if single is not None:
        one_time = median_after_first(single["times"])
        print(
            f"one process: {tokens / one_time:8.0f} tokens/s ({one_time:.2f} s per step); peak memory "
            f"{single['peak'] / MiB:.0f} MiB"
        )
    if cp[0]["report"]:
        print("\n" + cp[0]["report"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2, help="context-parallel degree (local ranks when not under torchrun)")
    p.add_argument(
        "--dp-shard", type=int, default=1, help="data-parallel shard degree (FSDP2 shards over dp_shard x cp)"
    )
    p.add_argument("--seq", type=int, default=512, help="tokens per packed sequence (try 8192)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layers", type=int, default=2, help="debugmodel blocks (it has 6)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--inner", default="inductor", choices=("inductor", "aot_eager"))
    p.add_argument("--no-compare", dest="compare", action="store_false", help="skip the one-process run")
    p.add_argument("--explain", action="store_true", help="print what the CP backend did to the block graphs")
    p.add_argument("--threads-per-rank", type=int, default=1)
    args = p.parse_args()

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: NCCL on GPUs, gloo on CPU
        import torch.distributed as dist

        import cp_compile  # noqa: F401  (before the group exists: docs/guides/errors.md, "A rank aborts or hangs as it exits")

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
        row = cp_rank(args)
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return 0
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    else:
        from cp_compile.tools.launch import RankPool

        world = args.cp * args.dp_shard
        print(
            f"training with FSDP2 + CP on {world} local ranks (gloo, CPU, {args.threads_per_rank} thread each)...",
            flush=True,
        )
        with RankPool(world, threads_per_rank=args.threads_per_rank, pg_timeout=3600) as pool:
            rows = pool.run(cp_rank, args, timeout=24 * 3600)
        device = torch.device("cpu")
        torch.set_num_threads(args.threads_per_rank)  # the same compute per process as one rank had
    single = None
    if args.compare:
        print("training the same model in one process...", flush=True)
        single = one_process(args, device)
    summary(args, rows, single)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
    sys.exit(main())
