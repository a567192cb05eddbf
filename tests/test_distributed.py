"""kvzoo.distributed across processes: gloo ranks spawned by the test (tests/distributed_scenarios.py).

Each test launches its ranks once and reads every check they recorded. The checks a test
requires are listed here from kvzoo's modes and layouts, so a mode the scenarios skipped, or a
check that never ran, fails the test as a failed check does. The launch is bounded: past its
timeout every rank is killed and the test fails with the ranks' logs.
"""

from __future__ import annotations

import pytest
import torch
from distributed_scenarios import launch, moved_modes

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is not available",
)

# Generous for a loaded 2-core machine (a run takes about 20 s there); a hang fails at this.
LAUNCH_TIMEOUT = 150.0


def _sharded(world: int) -> list[str]:
    return [f"sharded W={world} {m.name}/{layout}" for m in moved_modes() for layout in m.layouts]


def _check(result: dict, required: dict[int, list[str]], killed: tuple[int, ...] = ()) -> None:
    problems = []
    for rank, r in result.items():
        if r["timed_out"]:
            problems.append(f"rank {rank}: the launch passed its {LAUNCH_TIMEOUT:g} s bound")
        expected_exit = -9 if rank in killed else 0
        if r["returncode"] != expected_exit:
            problems.append(f"rank {rank}: exit {r['returncode']}, expected {expected_exit}\n{r['log']}")
        seen = {rec["name"]: rec for rec in r["records"]}
        for rec in r["records"]:
            if rec["status"] not in ("ok", "info"):
                problems.append(f"rank {rank} {rec['status']} {rec['name']}: {rec['detail']}")
        for name in required.get(rank, []):
            if name not in seen:
                problems.append(f"rank {rank}: check {name!r} did not run")
    assert not problems, "\n".join(problems)


def test_two_ranks_shard_transfer_reshard_refuse_and_survive_a_timeout_and_a_killed_sender(tmp_path):
    result = launch(2, tmp_path, timeout=LAUNCH_TIMEOUT)
    transfers = [f"transfer 0->1 {m.name}/{a}->{b}" for m in moved_modes() for a in m.layouts for b in m.layouts]
    refusals = [
        f"refusal {f}" for f in ("mode", "total_kv_heads", "head_size", "static_scales[0]", "rows", "checksums")
    ]
    failures = ["timeout: the sender stalls after the handshake", "kill: the sender is killed after its first layer"]
    reshard = [f"reshard 0->[0, 1] {m.name}/separate->{m.layouts[-1]}" for m in moved_modes()]
    every = _sharded(2) + refusals + transfers + reshard + failures
    # Rank 0 is killed in the last check, after recording the others.
    _check(result, {0: every[:-1], 1: every}, killed=(0,))
    kill = {rec["name"]: rec for rec in result[1]["records"]}[failures[1]]
    assert "receiving layer 1's pages" in kill["detail"], kill["detail"]  # killed mid-transfer, not before


def test_four_ranks_shard_over_the_group_and_its_halves_and_reshard_one_to_two(tmp_path):
    result = launch(4, tmp_path, scenarios=("sharded", "reshard"), timeout=LAUNCH_TIMEOUT)
    reshard = [f"reshard 0->[2, 3] {m.name}/separate->{m.layouts[-1]}" for m in moved_modes()]
    sharded = _sharded(4) + _sharded(2)
    _check(result, {0: sharded + reshard, 1: sharded, 2: sharded + reshard, 3: sharded + reshard})


def test_the_scaleout_benchmark_runs_and_counts_the_pages_bytes(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "scaleout.json"
    script = Path(__file__).resolve().parents[1] / "bench" / "scaleout_transfer.py"
    args = ["--tokens", "256", "--layers", "2", "--repeats", "1", "--seq-len", "100", "--json", str(out)]
    args += ["--modes", "int8_per_token_head,int4_per_token_head,none", "--dir", str(tmp_path)]
    subprocess.run([sys.executable, str(script), *args], check=True, timeout=LAUNCH_TIMEOUT, capture_output=True)
    result = json.loads(out.read_text())
    # Per token and layer, K and V of 8 heads: int8 rows of 128 codes and a float32 scale, int4
    # rows of 64 bytes and a scale, bf16 rows of 256 bytes. 256 tokens in sequences of 100 take
    # 7 + 7 + 4 blocks of 16: the pages are 18 x 16 token slots.
    per_slot = {"int8_per_token_head": 2 * 8 * 132, "int4_per_token_head": 2 * 8 * 68, "none": 2 * 8 * 256}
    for row in result["rows"]:
        assert row["bytes"] == 2 * 18 * 16 * per_slot[row["mode"]], row
        for key in ("send", "send_workspace", "save", "load", "offload"):
            assert row[key + "_s"] > 0
        for key in ("send", "save", "load", "offload"):
            assert row["raw_" + key + "_s"] > 0
    assert {r["mode"] for r in result["rows"]} == set(per_slot) and result["info"]["commit"]
