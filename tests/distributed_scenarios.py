"""Multi-process scenarios of kvzoo.distributed, one process per rank (gloo on CPUs, NCCL on GPUs).

Run by tests/test_distributed.py (gloo, 2 and 4 processes) and by hand on GPUs:

    python tests/distributed_scenarios.py --world 2 --backend nccl --device cuda --impl auto --long

The launcher (no --rank) starts one process per rank, each running the scenarios in order and
writing a JSON record per check to OUT/rank{r}.json; it kills a rank that asks to be killed
(a file OUT/kill.{r}: the killed-sender scenario) and every rank past --timeout, then prints one
line per check and exits 1 if any failed. Every rank draws the shared inputs from the same seed
(KVZOO_SEED, printed), so each can compute the single-process reference itself.

Scenarios:
  sharded   every mode x layout: a head-sharded write + attention (prefill, then decode) over
            the whole group (and, with 4 or more ranks, over two halves at once) gathers to the
            single-process run's output bytes, and each rank's cache holds the single-process
            cache's bytes for its heads. --long adds a decode at context 5000 with
            batch_invariant=True (must be equal) and without (reported only: Triton's split).
  refusals  pages of another mode, another head count, other static scales, too few rows: both
            sides raise naming the field, the receiver's cache and tables untouched.
  transfer  rank 0 -> 1, every mode x (sender layout, receiver layout), two layers, three
            sequences (two sharing a block): the receiver's blocks hold the sender's bytes, its
            other blocks and table rows are untouched, and three decode steps give the sender's
            attention bytes.
  reshard   rank 0 holding every head -> the last two ranks, head-sharded between them
            (with two ranks: ranks 0 and 1, rank 0 placing its half from its own pages); decode
            there, gathered, gives rank 0's bytes.
  timeout   the sender stalls after the handshake: the receiver raises within its timeout,
            nothing written, the allocator not called.
  kill      (last) the sender is SIGKILLed after its first layer's message: the receiver
            raises, nothing written.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

ALL = ("sharded", "refusals", "transfer", "reshard", "timeout", "kill")
HERE = Path(__file__).resolve().parent


# ------------------------------------------------------------------------------------------
# Launcher (imports no torch: it only starts and watches the ranks).


def moved_modes() -> list:
    """The modes kvzoo.distributed moves: the one-format ones (split ones are refused:
    tests/test_pages.py). kvzoo imported here, so the launcher's import stays light."""
    import kvzoo

    return [m for m in kvzoo.MODES.values() if not m.split]


def launch(
    world: int,
    out: Path,
    *,
    scenarios=ALL,
    backend="gloo",
    device="cpu",
    impl="numpy",
    timeout=120.0,
    long=False,
    group_timeout=60.0,
) -> dict:
    """Run the scenarios on `world` processes; returns {rank: {"returncode", "records", "log"}}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*"):
        stale.unlink()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    if impl == "numpy":
        env.setdefault("KVZOO_DISABLE_NUMBA", "1")  # 1 s of import per rank, never used
    if device == "cpu":
        env.setdefault("TRITON_INTERPRET", "1")
    if backend == "nccl":
        # torch's watchdog tears a process down when its communicator reports a dead peer
        # (the default, 3); 2 aborts the communicator only, so the receiver of the killed
        # sender lives to check its cache.
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    args = [sys.executable, str(Path(__file__).resolve()), "--world", str(world), "--out", str(out)]
    args += ["--backend", backend, "--device", device, "--impl", impl, "--scenarios", ",".join(scenarios)]
    args += ["--group-timeout", str(group_timeout)] + (["--long"] if long else [])
    procs = []
    for rank in range(world):
        log = open(out / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([*args, "--rank", str(rank)], env=env, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    deadline = time.monotonic() + timeout
    timed_out = False
    while any(p.poll() is None for p in procs):
        for rank, p in enumerate(procs):
            if p.poll() is None and (out / f"kill.{rank}").exists():
                p.kill()
        if time.monotonic() > deadline:
            timed_out = True
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    result = {}
    for rank, p in enumerate(procs):
        p.wait()
        path = out / f"rank{rank}.json"
        records = json.loads(path.read_text()) if path.exists() else []
        log = (out / f"rank{rank}.log").read_text(errors="replace")
        result[rank] = {
            "returncode": p.returncode,
            "killed_on_request": (out / f"kill.{rank}").exists(),
            "timed_out": timed_out,
            "records": records,
            "log": log[-4000:],
        }
    return result


def summary(result: dict) -> tuple[list[str], bool]:
    lines, ok = [], True
    for rank, r in result.items():
        expected_exit = r["returncode"] == 0 or (r["killed_on_request"] and r["returncode"] == -9)
        if r["timed_out"] or not expected_exit:
            ok = False
            lines.append(f"rank {rank}: exit {r['returncode']} (timed out: {r['timed_out']})\n{r['log']}")
        for rec in r["records"]:
            ok &= rec["status"] in ("ok", "skip", "info")
            lines.append(f"rank {rank} {rec['status']:>4} {rec['seconds']:6.2f}s {rec['name']}: {rec['detail']}")
    return lines, ok


# ------------------------------------------------------------------------------------------
# Rank side.


class Ctx:
    def __init__(self, args):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.args = torch, dist, args
        self.rank, self.world = args.rank, args.world
        if args.device == "cuda":
            torch.cuda.set_device(self.rank)
            self.device = f"cuda:{self.rank}"
        else:
            self.device = "cpu"
        self.impl = None if args.impl == "auto" else args.impl
        self.out = Path(args.out)
        self.records = []
        self.group_timeout = timedelta(seconds=args.group_timeout)
        dist.init_process_group(
            args.backend,
            init_method=f"file://{self.out / 'rendezvous'}",
            rank=self.rank,
            world_size=self.world,
            timeout=self.group_timeout,
        )
        # The test channel's tensors travel where the backend takes them.
        self.wire = torch.device(self.device if args.backend == "nccl" else "cpu")

    def record(self, name, status, detail, seconds):
        self.records.append({"name": name, "status": status, "detail": detail, "seconds": round(seconds, 3)})
        tmp = self.out / f".rank{self.rank}.json"
        tmp.write_text(json.dumps(self.records, indent=1))
        tmp.replace(self.out / f"rank{self.rank}.json")

    def check(self, name, fn, *a, **k):
        t0 = time.monotonic()
        from kvzoo.registry import NoImplementationError

        try:
            detail = fn(*a, **k)
            status = "ok"
            if isinstance(detail, tuple):
                status, detail = detail
        except NoImplementationError as exc:  # a mode the chosen implementation does not take
            status, detail = "skip", str(exc).splitlines()[0]
        except Exception as exc:
            status, detail = "fail", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
        self.record(name, status, detail or "", time.monotonic() - t0)

    # The test's own channel (not the library's): a tensor's bytes, its size first.
    def send_bits(self, t, dst, group=None):
        torch = self.torch
        data = bits(t).contiguous().view(torch.uint8).reshape(-1).to(self.wire)
        self.dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=self.wire), dst, group=group)
        self.dist.send(data, dst, group=group)

    def recv_bits(self, src, group=None):
        torch = self.torch
        n = torch.empty(1, dtype=torch.int64, device=self.wire)
        self.dist.recv(n, src, group=group)
        data = torch.empty(int(n.item()), dtype=torch.uint8, device=self.wire)
        self.dist.recv(data, src, group=group)
        return data.cpu()


def bits(x):
    """An integer view of x's elements (same width), so comparisons are of bits."""
    import torch

    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def arrays(tensors):
    return [
        a
        for a in (tensors.key_cache, tensors.value_cache, tensors.k_scale_cache, tensors.v_scale_cache)
        if a is not None
    ]


def snapshot(layers):
    return [[bits(a).clone() for a in arrays(t)] for t in layers]


def poison(layers, rng):
    """Random bytes (never zero) everywhere: a byte the library must not write stays this."""
    import torch

    for t in layers:
        whole = [t.buffer] if t.buffer is not None else arrays(t)
        for a in whole:
            raw = a.view(torch.uint8)
            noise = rng.integers(1, 256, size=tuple(raw.shape), dtype="uint8")
            raw.copy_(torch.from_numpy(noise).to(raw.device))


def untouched(layers, snap, skip_blocks=()):
    import torch

    for n, (t, before) in enumerate(zip(layers, snap)):
        for a, b in zip(arrays(t), before):
            keep = torch.ones(a.shape[0], dtype=torch.bool, device=a.device)
            keep[list(skip_blocks)] = False
            if not torch.equal(bits(a)[keep], b[keep]):
                raise AssertionError(f"layer {n}: a block outside the placed ones changed")


# Shapes: small, so the NumPy implementation runs them in well under a second each.
D, BS = 16, 8


def _spec(ctx, mode, heads, *, layout="separate", num_blocks=24, head_size=D):
    import kvzoo

    return kvzoo.CacheSpec(
        mode,
        num_blocks=num_blocks,
        block_size=BS,
        num_kv_heads=heads,
        head_size=head_size,
        layout=layout,
        model_dtype="bfloat16",
        device=ctx.device,
    )


def _static(mode, rng):
    if not mode.per_tensor:
        return None
    return (float(rng.uniform(0.02, 0.05)), float(rng.uniform(0.02, 0.05)))


def _kv(rng, tokens, heads, device, dtype="bfloat16"):
    import torch

    x = torch.from_numpy(rng.standard_normal((tokens, heads, D)).astype("float32"))
    return x.to(getattr(torch, dtype)).to(device)


class _Writer:
    """Write + attention steps through plan_step on one cache (or one rank's share of one)."""

    def __init__(self, ctx, plan_for, static):
        self.ctx, self.plan_for, self.static = ctx, plan_for, static

    def step(self, caches, tables, lens, q_lens, slots, kvs, queries, **extra):
        torch = self.ctx.torch
        dev = self.ctx.device
        qsl = [0]
        for q in q_lens:
            qsl.append(qsl[-1] + q)
        width = max(len(r) for r in tables)
        table = torch.tensor([r + [0] * (width - len(r)) for r in tables], dtype=torch.int32, device=dev)
        plan = self.plan_for(
            block_tables=table,
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            impl=self.ctx.impl,
            **extra,
        )
        scales = {} if self.static is None else {"k_scale": self.static[0], "v_scale": self.static[1]}
        outs = []
        for layer, ((k, v), q) in enumerate(zip(kvs, queries)):
            plan.write(k, v, caches[layer], **scales)
            outs.append(plan.attention(q, caches[layer], **scales))
        return outs


def _slots(table_row, positions):
    return [table_row[p // BS] * BS + p % BS for p in positions]


# ---------------------------------------------------------------- sharded


def sharded(ctx):

    groups = [(list(range(ctx.world)), None)]
    if ctx.world >= 4:
        halves = [list(range(ctx.world // 2)), list(range(ctx.world // 2, ctx.world))]
        made = [ctx.dist.new_group(h) for h in halves]
        groups += [(h, g) for h, g in zip(halves, made) if ctx.rank in h]
    for members, group in groups:
        W = len(members)
        for mode in moved_modes():
            for layout in mode.layouts:
                name = f"sharded W={W} {mode.name}/{layout}"
                ctx.check(name, _sharded_case, ctx, mode, layout, W, group)
                if ctx.args.long:
                    for invariant in (True, False):
                        ctx.check(
                            f"{name} context 5000 batch_invariant={invariant}",
                            _sharded_long,
                            ctx,
                            mode,
                            layout,
                            W,
                            group,
                            invariant,
                        )


def _sharded_specs(ctx, mode, layout, W, group, num_blocks):
    from kvzoo.distributed import shard_spec

    Hkv = 2 * W
    Hq = 2 * Hkv
    full = _spec(ctx, mode, Hkv, layout=layout, num_blocks=num_blocks)
    return full, Hq, shard_spec(full, Hq, group=group)


def _sharded_case(ctx, mode, layout, W, group):
    import torch

    import kvzoo
    from kvzoo.inputs import rng_for

    full, Hq, shard = _sharded_specs(ctx, mode, layout, W, group, 16)
    rng = rng_for("sharded", mode.name, layout, W)
    static = _static(mode, rng)
    sinks = torch.from_numpy(rng.uniform(-1, 1, Hq).astype("float32")).to(ctx.device)
    tables = [list(map(int, b)) for b in rng.permutation(16)[:9].reshape(3, 3)]
    prefill = [13, 5, 9]
    ref_caches, mine = [full.allocate()], [shard.allocate()]
    ref = _Writer(ctx, lambda **k: kvzoo.plan_step(full, num_q_heads=Hq, sinks=sinks, **k), static)
    loc = _Writer(ctx, lambda **k: shard.plan_step(sinks=sinks, **k), static)
    steps = [
        (prefill, prefill, [s for r, n in zip(tables, prefill) for s in _slots(r, range(n))]),
        ([n + 1 for n in prefill], [1, 1, 1], [_slots(r, [n])[0] for r, n in zip(tables, prefill)]),
    ]
    for step, (lens, q_lens, slots) in enumerate(steps):
        T = sum(q_lens)
        k, v = _kv(rng, T, full.num_kv_heads, ctx.device), _kv(rng, T, full.num_kv_heads, ctx.device)
        q = _kv(rng, T, Hq, ctx.device)
        (want,) = ref.step(ref_caches, tables, lens, q_lens, slots, [(k, v)], [q])
        (part,) = loc.step(
            mine, tables, lens, q_lens, slots, [(shard.local_kv(k), shard.local_kv(v))], [shard.local_q(q)]
        )
        got = shard.gather(part)
        if not torch.equal(bits(got), bits(want)):
            diff = (bits(got) != bits(want)).sum().item()
            raise AssertionError(f"step {step}: {diff} of {want.numel()} output elements differ from one process's")
    heads = slice(shard.kv_heads.start, shard.kv_heads.stop)
    for a, b in zip(arrays(mine[0]), arrays(ref_caches[0])):
        if not torch.equal(bits(a), bits(b)[:, :, heads]):
            raise AssertionError("this rank's cache is not the single-process cache's bytes for its heads")
    return f"{W} ranks, KV heads {list(shard.kv_heads)} of {full.num_kv_heads}, query heads {list(shard.q_heads)}"


def _sharded_long(ctx, mode, layout, W, group, invariant):
    import torch

    import kvzoo
    from kvzoo.inputs import rng_for

    n = 5000
    blocks = -(-(n + 1) // BS)
    full, Hq, shard = _sharded_specs(ctx, mode, layout, W, group, blocks)
    rng = rng_for("sharded-long", mode.name, layout, W)
    static = _static(mode, rng)
    table = [list(map(int, rng.permutation(blocks)))]
    ref_caches, mine = [full.allocate()], [shard.allocate()]
    ref = _Writer(ctx, lambda **k: kvzoo.plan_step(full, num_q_heads=Hq, **k), static)
    loc = _Writer(ctx, lambda **k: shard.plan_step(**k), static)
    outs = []
    for lens, q_lens, slots in (([n], [n], _slots(table[0], range(n))), ([n + 1], [1], _slots(table[0], [n]))):
        T = sum(q_lens)
        k, v = _kv(rng, T, full.num_kv_heads, ctx.device), _kv(rng, T, full.num_kv_heads, ctx.device)
        q = _kv(rng, T, Hq, ctx.device)
        (want,) = ref.step(ref_caches, table, lens, q_lens, slots, [(k, v)], [q], batch_invariant=invariant)
        (part,) = loc.step(
            mine,
            table,
            lens,
            q_lens,
            slots,
            [(shard.local_kv(k), shard.local_kv(v))],
            [shard.local_q(q)],
            batch_invariant=invariant,
        )
        outs.append((shard.gather(part), want))
    got, want = outs[-1]
    equal = torch.equal(bits(got), bits(want))
    if invariant and not equal:
        raise AssertionError("decode at context 5000 with batch_invariant: outputs differ from one process's")
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    return ("ok" if equal else "info"), f"decode bytes equal: {equal} (relative difference {rel:.2e})"


# ---------------------------------------------------------------- transfer


class _Free:
    """A free-block list that records the allocator's calls."""

    def __init__(self, blocks):
        self.blocks, self.calls = list(blocks), []

    def __call__(self, n):
        self.calls.append(n)
        taken, self.blocks = self.blocks[:n], self.blocks[n:]
        return taken


def _transfer_inputs(mode, tag, Hkv, Hq, layers, device):
    """The shared inputs of a transfer case: prefill K/V of sequences 0 and 2 (sequence 1 is
    sequence 0's first block) and three decode steps of all three, per layer."""
    from kvzoo.inputs import rng_for

    rng = rng_for("transfer-inputs", mode.name, tag)
    lens = [20, 8, 17]
    prefill = [[(_kv(rng, n, Hkv, device), _kv(rng, n, Hkv, device)) for _ in range(layers)] for n in (20, 17)]
    decode = [
        (
            [(_kv(rng, 3, Hkv, device), _kv(rng, 3, Hkv, device)) for _ in range(layers)],
            [_kv(rng, 3, Hq, device) for _ in range(layers)],
        )
        for _ in range(3)
    ]
    return lens, prefill, decode, _static(mode, rng)


def _decode(writer, caches, tables, lens, free, decode, kv_take=lambda x: x, q_take=lambda x: x):
    """Three decode steps of every sequence; a sequence takes a new block when it fills one."""
    outs = []
    tables = [list(r) for r in tables]
    lens = list(lens)
    for kvs, queries in decode:
        slots = []
        for s, n in enumerate(lens):
            if n % BS == 0 and n // BS == len(tables[s]):
                tables[s].append(free(1)[0])
            slots.append(_slots(tables[s], [n])[0])
        lens = [n + 1 for n in lens]
        kvs = [(kv_take(k), kv_take(v)) for k, v in kvs]
        outs += writer.step(caches, tables, lens, [1, 1, 1], slots, kvs, [q_take(q) for q in queries])
    return outs


def _prefill_sender(ctx, spec, Hq, layers_n, inputs, free):
    """Sender side: write sequences 0 and 2 (sequence 1 shares sequence 0's first block)."""
    import kvzoo

    lens, prefill, _, static = inputs
    caches = [spec.allocate() for _ in range(layers_n)]
    t0, t2 = free(3), free(3)
    tables = [t0, t0[:1], t2]
    writer = _Writer(ctx, lambda **k: kvzoo.plan_step(spec, num_q_heads=Hq, **k), static)
    slots = _slots(t0, range(20)) + _slots(t2, range(17))
    kvs = []
    for layer in range(layers_n):
        (k0, v0), (k2, v2) = prefill[0][layer], prefill[1][layer]
        kvs.append((ctx.torch.cat([k0, k2]), ctx.torch.cat([v0, v2])))
    queries = [ctx.torch.zeros(37, Hq, D, dtype=ctx.torch.bfloat16, device=ctx.device) for _ in range(layers_n)]
    writer.step(caches, [t0, t2], [20, 17], [20, 17], slots, kvs, queries)
    return caches, tables, writer


def _block_bits(caches, tables):
    """Every (sequence, page) block's bits, in table order: what the receiver must hold."""
    import torch

    parts = []
    for t in caches:
        for a in arrays(t):
            idx = torch.tensor([b for row in tables for b in row], device=a.device)
            parts.append(bits(a).index_select(0, idx).contiguous().view(torch.uint8).reshape(-1).cpu())
    return torch.cat(parts)


def _tensor_table(ctx, tables, width, dtype="int32"):
    torch = ctx.torch
    return torch.tensor([r + [0] * (width - len(r)) for r in tables], dtype=getattr(torch, dtype), device=ctx.device)


def transfer(ctx):

    if ctx.rank > 1:
        return
    for mode in moved_modes():
        for src_layout in mode.layouts:
            for dst_layout in mode.layouts:
                ctx.check(
                    f"transfer 0->1 {mode.name}/{src_layout}->{dst_layout}",
                    _transfer_case,
                    ctx,
                    mode,
                    src_layout,
                    dst_layout,
                )


def _transfer_case(ctx, mode, src_layout, dst_layout):
    import torch

    import kvzoo
    from kvzoo.distributed import recv_pages, send_pages
    from kvzoo.inputs import rng_for

    Hkv, Hq, L, NB = 2, 4, 2, 24
    tag = f"{src_layout}->{dst_layout}"
    inputs = _transfer_inputs(mode, tag, Hkv, Hq, L, ctx.device)
    lens, _, decode, static = inputs
    rng = rng_for("transfer-rank", mode.name, tag, ctx.rank)
    layout = src_layout if ctx.rank == 0 else dst_layout
    spec = _spec(ctx, mode, Hkv, layout=layout, num_blocks=NB)
    free = _Free(map(int, rng.permutation(NB)))
    scales = None if static is None else [static] * L
    # A workspace holding the pages (same layouts), one too small to (the int8 modes: fresh
    # memory then), or none.
    size = 0 if src_layout != dst_layout else (16 if "int8" in mode.name else 1 << 20)
    workspace = torch.from_numpy(rng.integers(1, 256, size, dtype="uint8")).to(ctx.device) if size else None
    if ctx.rank == 0:
        caches, tables, writer = _prefill_sender(ctx, spec, Hq, L, inputs, free)
        sent = send_pages(
            caches,
            spec,
            _tensor_table(ctx, tables, 3),
            torch.tensor(lens, device=ctx.device),
            dst=1,
            seq_ids=["a", "b", "c"],
            static_scales=scales,
            timeout=60,
            workspace=workspace,
        )
        ctx.send_bits(_block_bits(caches, tables), 1)
        for out in _decode(writer, caches, tables, lens, free, decode):
            ctx.send_bits(out, 1)
        return f"sent {sent} bytes"
    caches = [spec.allocate() for _ in range(L)]
    poison(caches, rng)
    snap = snapshot(caches)
    engine_table = torch.from_numpy(rng.integers(0, NB, (6, 8)).astype("int32")).to(ctx.device)
    engine_lens = torch.from_numpy(rng.integers(0, 99, 6).astype("int32")).to(ctx.device)
    table_before, lens_before = engine_table.clone(), engine_lens.clone()
    rows = [4, 0, 2]
    placed = recv_pages(
        caches,
        spec,
        src=0,
        allocate=free,
        block_tables=engine_table,
        rows=rows,
        seq_lens=engine_lens,
        static_scales=scales,
        timeout=60,
        workspace=workspace,
    )
    new_tables = [[int(b) for b in r if b >= 0] for r in placed.block_tables.tolist()]
    assert placed.seq_lens.tolist() == lens and placed.seq_ids == ("a", "b", "c"), (placed.seq_lens, placed.seq_ids)
    assert new_tables[1] == new_tables[0][:1], f"the shared block became two: {new_tables}"
    assert free.calls == [6], f"the allocator was asked for {free.calls}, the pages are 6 blocks"
    for s, r in enumerate(rows):
        n = len(new_tables[s])
        assert engine_table[r, :n].tolist() == new_tables[s] and engine_table[r, n:].equal(table_before[r, n:])
        assert int(engine_lens[r]) == lens[s]
    others = [r for r in range(6) if r not in rows]
    assert engine_table[others].equal(table_before[others]) and engine_lens[others].equal(lens_before[others])
    untouched(caches, snap, skip_blocks=placed.block_ids.tolist())
    received = _block_bits(caches, new_tables)
    writer = _Writer(ctx, lambda **k: kvzoo.plan_step(spec, num_q_heads=Hq, **k), static)
    outs = _decode(writer, caches, new_tables, lens, free, decode)
    theirs = [ctx.recv_bits(0) for _ in range(1 + len(outs))]
    if not torch.equal(theirs[0], received):
        raise AssertionError("the received blocks are not the sender's bytes")
    for step, out in enumerate(outs):
        if not torch.equal(theirs[1 + step], bits(out).contiguous().view(torch.uint8).reshape(-1).cpu()):
            raise AssertionError(f"decode output {step} (step {step // L}, layer {step % L}) differs from the sender's")
    return f"blocks {placed.block_ids.tolist()}; 3 decode steps x {L} layers equal"


# ---------------------------------------------------------------- reshard


def reshard(ctx):

    # Rank 0 prefills every head; two decode ranks hold half each. With two ranks, rank 0 is
    # also the first decode rank (prefill and decode on one GPU, as a colocated engine runs):
    # it places its half from its own pages and sends the other half.
    decoders = [0, 1] if ctx.world == 2 else [ctx.world - 2, ctx.world - 1]
    group = ctx.dist.new_group(decoders) if ctx.world > 2 else None
    if ctx.rank not in (0, *decoders):
        return
    for mode in moved_modes():
        ctx.check(
            f"reshard 0->{decoders} {mode.name}/separate->{mode.layouts[-1]}", _reshard_case, ctx, mode, decoders, group
        )


def _reshard_case(ctx, mode, decoders, group):
    import torch

    from kvzoo.distributed import gather_pages, place_pages, recv_pages, send_pages, shard_spec
    from kvzoo.inputs import rng_for

    Hkv, Hq, L, NB = 4, 8, 2, 24
    inputs = _transfer_inputs(mode, "reshard", Hkv, Hq, L, ctx.device)
    lens, _, decode, static = inputs
    rng = rng_for("reshard-rank", mode.name, ctx.rank)
    scales = None if static is None else [static] * L
    prefill_spec = _spec(ctx, mode, Hkv, layout="separate", num_blocks=NB)
    decode_spec = _spec(ctx, mode, Hkv, layout=mode.layouts[-1], num_blocks=NB)
    reference = None
    if ctx.rank == 0:
        free = _Free(map(int, rng.permutation(NB)))
        caches, tables, writer = _prefill_sender(ctx, prefill_spec, Hq, L, inputs, free)
        table, seq_lens = _tensor_table(ctx, tables, 3), torch.tensor(lens, device=ctx.device)
        for dst in decoders:
            if dst != 0:
                send_pages(caches, prefill_spec, table, seq_lens, dst=dst, static_scales=scales, timeout=60)
        sender_bits = _block_bits(caches, tables)
        for dst in decoders:
            if dst != 0:
                ctx.send_bits(sender_bits, dst)
        # Rank 0's own half is read now: its reference decode below writes into these blocks.
        own = gather_pages(caches, prefill_spec, table, seq_lens, static_scales=scales) if 0 in decoders else None
        reference = _decode(writer, caches, tables, lens, free, decode)
        if 0 not in decoders:
            for out in reference:
                ctx.send_bits(out, decoders[0])
            return f"sent to {decoders}"
    shard = shard_spec(decode_spec, Hq, group=group)
    mine = [shard.allocate() for _ in range(L)]
    poison(mine, rng_for("reshard-poison", mode.name, ctx.rank))
    snap = snapshot(mine)
    free_here = _Free(map(int, rng_for("reshard-free", mode.name, ctx.rank).permutation(NB)))
    if ctx.rank == 0:
        placed = place_pages(own, mine, shard, allocate=free_here, static_scales=scales)
        theirs = sender_bits
    else:
        placed = recv_pages(mine, shard, src=0, allocate=free_here, static_scales=scales, timeout=60)
        theirs = ctx.recv_bits(0)
    new_tables = [[int(b) for b in r if b >= 0] for r in placed.block_tables.tolist()]
    untouched(mine, snap, skip_blocks=placed.block_ids.tolist())
    # The sender's blocks, cut to this rank's heads, against what landed here.
    offset, want = 0, []
    pages_count = sum(len(r) for r in new_tables)
    heads = slice(shard.kv_heads.start, shard.kv_heads.stop)
    for t in [prefill_spec.allocate() for _ in range(L)]:  # only for the arrays' shapes
        for a in arrays(t):
            shape = (pages_count, *a.shape[1:])
            size = int(torch.tensor(shape).prod()) * a.element_size()
            block = theirs[offset : offset + size].view(bits(a).dtype).view(shape)
            want.append(block[:, :, heads].contiguous().view(torch.uint8).reshape(-1))
            offset += size
    received = _block_bits(mine, new_tables)  # before decode writes into the last blocks
    writer = _Writer(ctx, lambda **k: shard.plan_step(**k), static)
    outs = _decode(writer, mine, new_tables, lens, free_here, decode, shard.local_kv, shard.local_q)
    gathered = [bits(shard.gather(out)).contiguous().view(torch.uint8).reshape(-1).cpu() for out in outs]
    if ctx.rank == decoders[0]:
        wanted = (
            [bits(out).contiguous().view(torch.uint8).reshape(-1).cpu() for out in reference]
            if reference is not None
            else [ctx.recv_bits(0) for _ in outs]
        )
        for step, (got, expected) in enumerate(zip(gathered, wanted)):
            if not torch.equal(got, expected):
                raise AssertionError(f"decode output {step}: the decode ranks' gathered bytes differ from rank 0's")
    if not torch.equal(received, torch.cat(want)):
        raise AssertionError("the received blocks are not the sender's bytes for this rank's heads")
    return f"KV heads {list(shard.kv_heads)} of {Hkv}; 3 decode steps x {L} layers equal"


# ---------------------------------------------------------------- refusals


def refusals(ctx):
    if ctx.rank > 1:
        return
    cases = [
        ("mode", dict(mode="int8_per_token_head"), dict(mode="fp8_per_token_head")),
        ("total_kv_heads", dict(heads=2), dict(heads=4)),
        ("head_size", dict(head_size=16), dict(head_size=32)),
        ("static_scales[0]", dict(mode="fp8_per_tensor", scale=0.03), dict(mode="fp8_per_tensor", scale=0.04)),
        ("rows", dict(), dict(rows=[0])),
    ]
    for field, mine_s, mine_r in cases:
        ctx.check(f"refusal {field}", _refusal_case, ctx, field, mine_s if ctx.rank == 0 else mine_r)
    ctx.check("refusal checksums", _refusal_case, ctx, "checksums", {"corrupt": True})


def _refusal_case(ctx, field, cfg):
    import torch

    import kvzoo
    from kvzoo.distributed import TransferError, recv_pages, send_pages
    from kvzoo.distributed import transfer as transfer_module
    from kvzoo.inputs import rng_for

    mode = kvzoo.get_kv_quant_mode(cfg.get("mode", "int8_per_token_head"))
    spec = _spec(ctx, mode, cfg.get("heads", 2), num_blocks=8, head_size=cfg.get("head_size", D))
    caches = [spec.allocate()]
    scales = [(cfg["scale"], cfg["scale"])] if "scale" in cfg else None
    rng = rng_for("refusal", field, ctx.rank)
    real_checksum = transfer_module._checksum
    if cfg.get("corrupt") and ctx.rank == 0:
        # What a payload altered on the way gives: sums that are not the received bytes'.
        transfer_module._checksum = lambda flat: real_checksum(flat) + 1
    try:
        if ctx.rank == 0:
            send_pages(
                caches,
                spec,
                torch.tensor([[1], [2]], device=ctx.device),
                torch.tensor([5, 3], device=ctx.device),
                dst=1,
                static_scales=scales,
                timeout=30,
            )
        else:
            poison(caches, rng)
            snap = snapshot(caches)
            table = torch.full((4, 2), 7, dtype=torch.int32, device=ctx.device)
            free = _Free(range(8))
            try:
                recv_pages(
                    caches,
                    spec,
                    src=0,
                    allocate=free,
                    static_scales=scales,
                    timeout=30,
                    block_tables=table,
                    rows=cfg.get("rows", [0, 1]),
                )
            finally:
                untouched(caches, snap)
                assert bool((table == 7).all()) and not free.calls, "a refused transfer wrote the table or allocated"
    except TransferError as exc:
        if f"{field}:" not in str(exc) and f"match their {field}" not in str(exc):
            raise AssertionError(f"the refusal does not name {field!r}: {exc}") from None
        return str(exc)
    finally:
        transfer_module._checksum = real_checksum
    raise AssertionError("the transfer was not refused")


# ---------------------------------------------------------------- timeout and kill


def _failure_case(ctx, name, group):
    """Rank 1 receives three layers from rank 0 over `group`, which fails (how: `name`);
    it must raise with its cache, table and allocator untouched."""
    import torch

    from kvzoo.distributed import TransferError, recv_pages, send_pages
    from kvzoo.distributed import transfer as transfer_module
    from kvzoo.inputs import rng_for

    L, wait = 3, 4.0
    spec = _spec(ctx, "int8_per_token_head", 2, num_blocks=16)
    caches = [spec.allocate() for _ in range(L)]
    rng = rng_for("failure", name, ctx.rank)
    poison(caches, rng)
    if ctx.rank == 0:
        real_send_layers, real_gather = transfer_module._send_layers, transfer_module.gather_layer
        if name == "timeout":

            def stalled(*args):
                time.sleep(wait + 3)
                return 0

            transfer_module._send_layers = stalled
        else:

            def dies_at_layer_1(source, layer, header, out):
                if layer == 1:
                    time.sleep(1.0)  # layer 0's message is on its way
                    (ctx.out / "kill.0").write_text("now")
                    time.sleep(600)
                return real_gather(source, layer, header, out)

            transfer_module.gather_layer = dies_at_layer_1
        try:
            send_pages(
                caches,
                spec,
                torch.tensor([[3, 5, 9]], device=ctx.device),
                torch.tensor([20], device=ctx.device),
                dst=1,
                group=group,
                timeout=wait + 6,
            )
        except TransferError as exc:
            return f"the sender saw: {exc}"
        finally:
            transfer_module._send_layers, transfer_module.gather_layer = real_send_layers, real_gather
        raise AssertionError("the stalled sender's transfer completed")
    snap = snapshot(caches)
    table = torch.full((2, 4), -7, dtype=torch.int32, device=ctx.device)
    lens = torch.full((2,), 99, dtype=torch.int32, device=ctx.device)
    free = _Free(range(16))
    t0 = time.monotonic()
    try:
        recv_pages(
            caches,
            spec,
            src=0,
            allocate=free,
            group=group,
            block_tables=table,
            rows=[1],
            seq_lens=lens,
            # gloo sees the dead sender at once; NCCL may only by the deadline.
            timeout=wait if name == "timeout" else (15 if ctx.args.backend == "nccl" else 60),
        )
    except TransferError as exc:
        elapsed = time.monotonic() - t0
        untouched(caches, snap)
        assert bool((table == -7).all()) and bool((lens == 99).all()), "the block table or lengths were written"
        assert not free.calls, f"the allocator was called: {free.calls}"
        assert "Nothing was written" in str(exc), str(exc)
        if name == "timeout":
            assert wait - 0.5 < elapsed < wait + 5, f"raised after {elapsed:.1f} s for a timeout of {wait} s"
        if ctx.args.backend == "nccl":
            group.abort()  # an NCCL receive may still be posted (transfer.py's docstring)
        return f"raised after {elapsed:.1f} s: {str(exc)[:300]}"
    raise AssertionError("the receiver returned from a transfer that could not complete")


def timeout(ctx):
    group = ctx.dist.new_group([0, 1], timeout=timedelta(seconds=20))
    if ctx.rank <= 1:
        ctx.check("timeout: the sender stalls after the handshake", _failure_case, ctx, "timeout", group)


def kill(ctx):
    group = ctx.dist.new_group([0, 1], timeout=timedelta(seconds=30))
    if ctx.rank <= 1:
        ctx.check("kill: the sender is killed after its first layer", _failure_case, ctx, "kill", group)


def rank_main(args):
    ctx = Ctx(args)
    for name in args.scenarios.split(","):
        globals()[name](ctx)
        if name != "kill":
            # Ranks step through the scenarios together (a barrier on the test's own channel).
            ctx.dist.barrier()
    sys.stdout.flush()
    # Not destroy_process_group: after the kill scenario a peer is gone, and gloo's teardown
    # has nothing to say to it.
    os._exit(0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rank", type=int)
    p.add_argument("--out", default=None)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--impl", default="numpy", help="an implementation name, or 'auto' (the registry's choice)")
    p.add_argument("--scenarios", default=",".join(ALL))
    p.add_argument("--timeout", type=float, default=600.0, help="the launcher's bound on the whole run (s)")
    p.add_argument("--group-timeout", type=float, default=60.0)
    p.add_argument("--long", action="store_true", help="add the context-5000 decode to the sharded checks")
    args = p.parse_args(argv)
    if args.rank is not None:
        return rank_main(args)
    out = Path(args.out or f"/tmp/kvzoo-dist-{os.getpid()}")
    seed = os.environ.setdefault("KVZOO_SEED", str(int.from_bytes(os.urandom(4), "little")))
    print(
        f"kvzoo distributed scenarios: {args.world} ranks, {args.backend}, {args.device}, impl {args.impl}, "
        f"KVZOO_SEED={seed}, out {out}",
        flush=True,
    )
    result = launch(
        args.world,
        out,
        scenarios=args.scenarios.split(","),
        backend=args.backend,
        device=args.device,
        impl=args.impl,
        timeout=args.timeout,
        long=args.long,
        group_timeout=args.group_timeout,
    )
    lines, ok = summary(result)
    print("\n".join(lines))
    (out / "summary.json").write_text(json.dumps(result, indent=1))
    print("ALL OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
