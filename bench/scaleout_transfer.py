"""Scale-out throughput: kvzoo.distributed's page transfer, page files and host offload, each
against moving or saving the same bytes as one raw tensor.

    python bench/scaleout_transfer.py                                    # gloo, CPU, 2 ranks
    python bench/scaleout_transfer.py --backend nccl --device cuda --tokens 4096,32768,131072

Two ranks (torch.multiprocessing, one GPU each with --device cuda). Per mode and size: a cache
of `--tokens` tokens in sequences of `--seq-len`, `--layers` layers, `--kv-heads` x
`--head-size` (bf16 model), its pages filled with random bytes (a transfer moves bytes; their
values do not matter to its speed). Rows, each the median of `--repeats` runs after one
warm-up, timed on the receiving rank from a barrier to the call's return:

- transfer: send_pages on rank 0, recv_pages on rank 1 (handshake, gathering the pages from
  the cache, per-layer messages, checksums, staging, allocation, copy into the cache), with
  fresh staging memory, and again with a workspace kept across transfers (`workspace=`);
- raw send: one torch.distributed.send of a tensor of the same bytes into a preallocated one;
- link: the raw send of the largest size's bytes (at least 256 MiB), the link's measured rate;
- save / load: save_pages(gather_pages(...)) and place_pages(load_pages(...)) on rank 0,
  against safetensors' save_file / load_file of one raw uint8 tensor of the same bytes (the file
  in --dir; the OS page cache holds it, so this is the cost of the bytes' processing and a
  memory-speed write, not a disk's);
- offload: gather_pages(...).to_host() then place_pages back, against a copy of one tensor of
  the same bytes to the host and back (on a machine without CUDA both are plain copies);
- gather, place: gather_pages and place_pages alone (into fresh memory, and from the pages into
  the cache), the two copies the raw rows do not make.

Bytes per token are the pages' (codes, scales, alignment) per layer, against a bf16 cache's
2 x kv_heads x head_size x 2. --json writes the rows with the machine, versions and command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvzoo  # noqa: E402
from kvzoo.distributed import gather_pages, load_pages, place_pages, recv_pages, save_pages, send_pages  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import scaleout_table  # noqa: E402  (the page and this script print the same table)

HERE = Path(__file__).resolve().parent


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, repeats, group=None) -> float:
    """Median seconds of fn() over repeats (after one warm-up), each started after a barrier."""
    times = []
    for run in range(repeats + 1):
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if run:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fill(layers, seed: int) -> None:
    g = torch.Generator(device="cpu").manual_seed(seed)
    for t in layers:
        for a in [t.buffer] if t.buffer is not None else [t.key_cache, t.value_cache, t.k_scale_cache, t.v_scale_cache]:
            if a is not None:
                raw = a.view(torch.uint8)
                raw.copy_(torch.randint(0, 256, tuple(raw.shape), dtype=torch.uint8, generator=g))


def _case(args, rank, device, mode, tokens, tmp):
    per_seq = -(-args.seq_len // args.block_size)
    seqs = -(-tokens // args.seq_len)
    spec = kvzoo.CacheSpec(
        mode,
        num_blocks=seqs * per_seq,
        block_size=args.block_size,
        num_kv_heads=args.kv_heads,
        head_size=args.head_size,
        model_dtype="bfloat16",
        device=str(device),
    )
    layers = [spec.allocate() for _ in range(args.layers)]
    _fill(layers, rank)
    table = torch.arange(seqs * per_seq, device=device, dtype=torch.int32).reshape(seqs, per_seq)
    lens = torch.full((seqs,), args.seq_len, dtype=torch.int32, device=device)
    lens[-1] = tokens - args.seq_len * (seqs - 1)
    pages = gather_pages(layers, spec, table, lens)
    nbytes = pages.nbytes
    row = {"mode": spec.mode.name, "tokens": tokens, "layers": args.layers, "bytes": nbytes}
    row["bytes_per_token_layer"] = nbytes / tokens / args.layers
    row["bf16_bytes_per_token_layer"] = 2 * args.kv_heads * args.head_size * 2
    free = list(range(spec.num_blocks))

    def transfer():
        if rank == 0:
            send_pages(layers, spec, table, lens, dst=1, timeout=600)
        else:
            recv_pages(layers, spec, src=0, allocate=free, timeout=600)

    row["send_s"] = _timed(transfer, device, args.repeats)
    # The same with a workspace kept across transfers, as an engine would: no fresh staging memory.
    layer = pages.header.layer_bytes
    workspace = torch.empty(layer * (2 if rank == 0 else args.layers), dtype=torch.uint8, device=device)

    def transfer_in_workspace():
        if rank == 0:
            send_pages(layers, spec, table, lens, dst=1, timeout=600, workspace=workspace)
        else:
            recv_pages(layers, spec, src=0, allocate=free, timeout=600, workspace=workspace)

    row["send_workspace_s"] = _timed(transfer_in_workspace, device, args.repeats)
    wire = device if args.backend == "nccl" else torch.device("cpu")
    raw = torch.empty(nbytes, dtype=torch.uint8, device=wire)

    def raw_send():
        if rank == 0:
            dist.send(raw, 1)
        else:
            dist.recv(raw, 0)

    row["raw_send_s"] = _timed(raw_send, device, args.repeats)
    row["pages"] = pages.header.num_pages * args.layers
    if rank == 0 and not args.transfer_only:
        import safetensors.torch

        path, raw_path = tmp / "pages.safetensors", tmp / "raw.safetensors"
        group = dist.new_group([0])  # rank 0's own timings: a barrier of one
        row["save_s"] = _timed(
            lambda: save_pages(path, gather_pages(layers, spec, table, lens)), device, args.repeats, group
        )
        row["raw_save_s"] = _timed(
            lambda: safetensors.torch.save_file({"raw": raw.cpu()}, str(raw_path)), device, args.repeats, group
        )
        row["load_s"] = _timed(
            lambda: place_pages(load_pages(path), layers, spec, allocate=free), device, args.repeats, group
        )
        row["raw_load_s"] = _timed(
            lambda: raw.copy_(safetensors.torch.load_file(str(raw_path))["raw"]), device, args.repeats, group
        )
        row["file_bytes"] = path.stat().st_size
        # The two copies a raw tensor does not make: pages out of the cache, and into it.
        row["gather_s"] = _timed(lambda: gather_pages(layers, spec, table, lens), device, args.repeats, group)
        row["place_s"] = _timed(lambda: place_pages(pages, layers, spec, allocate=free), device, args.repeats, group)
        row["offload_s"] = _timed(
            lambda: place_pages(gather_pages(layers, spec, table, lens).to_host(), layers, spec, allocate=free),
            device,
            args.repeats,
            group,
        )
        pin = torch.cuda.is_available()
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        row["raw_offload_s"] = _timed(lambda: (host.copy_(raw), raw.copy_(host)), device, args.repeats, group)
        row["pinned"] = pin
    elif not args.transfer_only:
        dist.new_group([0])
    dist.barrier()
    return row


def _rank(rank, args, out_path, rendezvous):
    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        args.backend,
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=600),
    )
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for tokens in args.tokens:
            for mode in args.modes:
                rows.append(_case(args, rank, device, mode, tokens, Path(tmp)))
                if rank == 1:
                    print(f"  {mode} {tokens} tokens done", flush=True)
        # The link: one raw message of the largest size's bytes, at least 256 MiB.
        link = max([r["bytes"] for r in rows] + [256 << 20])
        wire = device if args.backend == "nccl" else torch.device("cpu")
        t = torch.empty(link, dtype=torch.uint8, device=wire)
        link_s = _timed(lambda: dist.send(t, 1) if rank == 0 else dist.recv(t, 0), device, args.repeats)
    if rank == 1:
        # Rank 1 timed the transfers; rank 0 the files and the offload.
        Path(out_path + ".r1").write_text(json.dumps({"rows": rows, "link": {"bytes": link, "seconds": link_s}}))
    else:
        Path(out_path + ".r0").write_text(json.dumps({"rows": rows}))
    dist.barrier()
    dist.destroy_process_group()


def _info(args) -> dict:
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if args.device == "cuda" else []
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git("rev-parse", "--short", "HEAD")
        + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else ""),
        "command": "python bench/scaleout_transfer.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores ({cpu})" + (f", {', '.join(gpus)}" if gpus else ""),
        "torch": torch.__version__,
        "backend": args.backend,
        "threads": args.threads,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--tokens", default="4096,16384", help="comma-separated cache sizes in tokens")
    ap.add_argument("--modes", default="int8_per_token_head,fp8_per_token_head,int4_per_token_head,none")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--dir", default=None, help="where the files are written (default: the system's temp dir)")
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--transfer-only", action="store_true", help="time the transfers alone (no files, no offload)")
    args = ap.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.modes = args.modes.split(",")
    if args.backend == "nccl" and (args.device != "cuda" or torch.cuda.device_count() < 2):
        ap.error("--backend nccl needs --device cuda and two GPUs")
    info = _info(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result")
        mp.spawn(_rank, args=(args, out, str(Path(tmp) / "rendezvous")), nprocs=2, join=True)
        r0, r1 = json.loads(Path(out + ".r0").read_text()), json.loads(Path(out + ".r1").read_text())
    rows = []
    for a, b in zip(r0["rows"], r1["rows"]):
        rows.append({**b, **{k: v for k, v in a.items() if k not in ("send_s", "send_workspace_s", "raw_send_s")}})
    result = {"info": info, "rows": rows, "link": r1["link"]}
    print(f"{info['date']}, {info['machine']}, torch {info['torch']}, {info['backend']}, commit {info['commit']}")
    print(f"`{info['command']}`; medians of {args.repeats} runs")
    print("\n".join(scaleout_table(result)))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
