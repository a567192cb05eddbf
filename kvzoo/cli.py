"""`kvzoo list` (the registry), `kvzoo check` (the conformance matrix on this machine) and
`kvzoo audit FILE` (what is wrong with a dumped paged cache)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
import traceback
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from . import __version__
from .errors import did_you_mean
from .modes import get_kv_quant_mode

if TYPE_CHECKING:
    from .registry import Registry


def _registry(args: argparse.Namespace, command: str) -> Registry | None:
    """The default registry, plus each --backend-module (None, after saying why, if one fails)."""
    from . import registry

    modules = args.backend_module or []
    if not modules:
        return registry.default()
    # A copy: a backend named on the command line is checked, not installed for later calls.
    reg = registry.default().copy()
    before = dict(reg.import_errors)
    reg.load(modules)
    failed = [m for m in modules if m in reg.import_errors and m not in before]
    for module in failed:
        print(
            f"kvzoo {command}: --backend-module {module} could not be loaded: {reg.import_errors[module]} "
            "(it must be importable, e.g. its directory on PYTHONPATH, and expose register(registry))",
            file=sys.stderr,
        )
    return None if failed else reg


def _runs(codes: list[int]) -> str:
    """Ascending codes as runs ("0-3,5,7-12")."""
    runs: list[list[int]] = []
    for code in codes:
        if runs and runs[-1][1] == code - 1:
            runs[-1][1] = code
        else:
            runs.append([code, code])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _list(args: argparse.Namespace) -> int:
    from .modes import MODES

    reg = _registry(args, "list")
    if reg is None:
        return 2
    if args.json:
        listed = [
            {
                "name": impl.name,
                "op": impl.op,
                "platform": impl.platform,
                "priority": impl.priority,
                "modes": sorted(impl.modes),
                "available": not why,
                "unavailable": why,
            }
            for impl in sorted(reg.implementations(), key=lambda i: (i.op, -i.priority, i.name))
            for why in [impl.listed_unavailable()]
        ]
        print(json.dumps({"implementations": listed, "import_errors": reg.import_errors}, indent=1))
        return 0
    # Mode names are long: a short code per mode keeps the table within 100 columns.
    short = {name: str(n) for n, name in enumerate(MODES)}
    rows = [("implementation", "operation", "platform", "prio", "modes", "status")]
    reasons: dict[str, list[str]] = {}
    for impl in sorted(reg.implementations(), key=lambda i: (i.op, -i.priority, i.name)):
        why = impl.listed_unavailable()
        if why:
            reasons[impl.name] = why
        rows.append(
            (
                impl.name,
                impl.op,
                impl.platform,
                str(impl.priority),
                _runs([n for n, m in enumerate(MODES) if m in impl.modes]),
                "available" if not why else "unavailable (below)",
            )
        )
    _print_table(rows)
    notes = ["modes: " + ", ".join(f"{code} {name}" for name, code in short.items())]
    notes += [
        f"{name} unavailable: " + "; ".join(w.removeprefix(f"{name}: ") for w in why) for name, why in reasons.items()
    ]
    print()
    for note in notes:
        print(textwrap.fill(note, width=100, subsequent_indent="  "))
    for module, error in reg.import_errors.items():
        print(f"backend {module} failed to import: {error}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .arrays import require_torch
    from .errors import KVZooInputError

    try:
        require_torch("kvzoo check (the conformance matrix holds implementations to it on torch tensors)")
    except KVZooInputError as missing:
        print(f"kvzoo check: {missing}", file=sys.stderr)
        return 2

    from . import inputs
    from .conformance import NotApplicable, matrix

    if args.seed is not None:
        inputs.SEED = args.seed  # read by every draw (inputs.rng_for), as KVZOO_SEED sets it

    reg = _registry(args, "check")
    if reg is None:
        return 2
    if args.impl:
        problem = _impl_problem(reg, args.impl)
        if problem:
            print(f"kvzoo check: {problem}", file=sys.stderr)
            return 2
    checks = [c for c in matrix(reg) if c.impl.available]
    if args.impl:
        checks = [c for c in checks if c.impl.name in args.impl]
    if args.op:
        checks = [c for c in checks if c.op in args.op]
    if args.mode:
        try:
            modes = {get_kv_quant_mode(m).name for m in args.mode}
        except ValueError as bad:
            print(f"kvzoo check: --{bad}", file=sys.stderr)
            return 2
        checks = [c for c in checks if modes & set(c.case_id.split("-"))]
    seed = inputs.SEED
    out = sys.stderr if args.json else sys.stdout  # with --json, stdout holds the JSON alone
    print(f"kvzoo check: {len(checks)} checks, seed {seed} (replay with --seed {seed} or KVZOO_SEED={seed})", file=out)
    counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    failures = []
    skips = []
    start = time.perf_counter()
    for check in tqdm(checks, unit="check", file=sys.stderr, disable=args.quiet):
        key = (check.impl.name, check.op)
        try:
            check.run()
            counts[key][0] += 1
        except NotApplicable as why:
            counts[key][2] += 1
            skips.append((check, why))
        except Exception as exc:  # a failing check is reported, the matrix goes on
            counts[key][1] += 1
            failures.append((check, exc))
            if args.exitfirst:
                break
    total_failed = sum(f for _, f, _ in counts.values())
    total_passed = sum(p for p, _, _ in counts.values())
    total_skipped = sum(s for _, _, s in counts.values())
    seconds = time.perf_counter() - start
    if args.json:
        summary = {
            "seed": seed,
            "passed": total_passed,
            "failed": total_failed,
            "skipped": total_skipped,
            "seconds": round(seconds, 1),
            "by_implementation": [
                {"implementation": impl, "operation": op, "passed": p, "failed": f, "skipped": n}
                for (impl, op), (p, f, n) in sorted(counts.items())
            ],
            "failures": [
                {"operation": c.op, "check": c.id, "error": f"{type(e).__name__}: {e}"[:2000]} for c, e in failures
            ],
            "skips": [{"operation": c.op, "check": c.id, "reason": str(why)} for c, why in skips],
        }
        print(json.dumps(summary, indent=1))
    else:
        rows = [("implementation", "operation", "passed", "failed", "skipped")]
        rows += [(impl, op, str(p), str(f), str(n)) for (impl, op), (p, f, n) in sorted(counts.items())]
        _print_table(rows)
        if args.verbose:
            for check, reason in skips:
                print(f"SKIPPED {check.op} {check.id}: {reason}")
        for check, error in failures[:20]:
            print(f"\nFAILED {check.op} {check.id}: {type(error).__name__}: {error}"[:2000])
            if args.verbose:
                traceback.print_exception(error)
        print(f"\n{total_passed} passed, {total_failed} failed, {total_skipped} skipped in {seconds:.1f}s")
    if not counts:
        print("kvzoo check: no check ran, so nothing was verified", file=sys.stderr)
        return 1
    # An implementation that declined every case it was given verified nothing: not a pass.
    idle = [f"{impl} {op}" for (impl, op), (p, f, _) in sorted(counts.items()) if not p and not f]
    if idle and not args.exitfirst:
        print(
            f"kvzoo check: ran no check of: {', '.join(idle)} (every case was declined; -v says why)", file=sys.stderr
        )
        return 1
    return 1 if total_failed else 0


def _impl_problem(reg, names: list[str]) -> str:
    """Why an implementation named on the command line cannot be checked here ('' if all can)."""
    known = sorted({i.name for i in reg.implementations()})
    for name in names:
        if name not in known:
            return (
                f"--impl: no implementation named {name!r}{did_you_mean(name, known)}; registered: {', '.join(known)}"
            )
        why = sorted({w for i in reg.implementations() if i.name == name for w in i.unavailable()})
        if why:
            hint = " (`kvzoo check --interpret` sets it)" if "TRITON_INTERPRET" in " ".join(why) else ""
            return f"{name} is unavailable here: {'; '.join(why)}{hint}"
    return ""


def _warmup(args: argparse.Namespace) -> int:
    from .backends import numba_cpu

    why = numba_cpu.unavailable()
    if why:
        print(f"kvzoo warmup: nothing to compile: {'; '.join(why)}", file=sys.stderr)
        return 1
    from .warmup import CARRIER_GROUPS, INPUT_DTYPES, STEPS, run_every_signature

    start = time.perf_counter()
    dtypes = tuple(args.dtypes.split(",")) if args.dtypes else INPUT_DTYPES
    unknown = sorted(set(dtypes) - set(INPUT_DTYPES))
    if unknown:
        print(f"kvzoo warmup: --dtypes {args.dtypes!r}: {unknown} not among {list(INPUT_DTYPES)}", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"kvzoo warmup: --jobs {args.jobs}: expected 1 or more", file=sys.stderr)
        return 2
    if args.jobs > 1 and not args.dtypes:
        return _warmup_in_processes(CARRIER_GROUPS, args.jobs, start)
    steps = STEPS * len(dtypes) // len(INPUT_DTYPES)
    print(f"kvzoo warmup: {steps} signatures (mode x input dtype); a cold cache takes {numba_cpu.COMPILE_ESTIMATE}")
    done = [0]

    def progress(step: str) -> None:
        # A line per step, on a terminal or in a log alike: a first compile must show it moves.
        done[0] += 1
        print(f"  [{done[0]}/{steps}] {step} ({time.perf_counter() - start:.0f} s)", flush=True)

    run_every_signature(progress=progress, dtypes=dtypes)
    print(
        f"kvzoo warmup: numba kernels compiled or loaded for {', '.join(dtypes)} inputs, every mode numba takes, in "
        f"{time.perf_counter() - start:.1f}s"
    )
    return 0


def _warmup_in_processes(groups: tuple[tuple[str, ...], ...], jobs: int, start: float) -> int:
    """kvzoo warmup once per group of input dtypes, up to `jobs` at a time, each in its own
    process (the groups share no signature: warmup.CARRIER_GROUPS); their output interleaved."""
    import subprocess

    pending = [",".join(group) for group in groups]
    running: list[subprocess.Popen] = []
    failed = 0
    while pending or running:
        while pending and len(running) < jobs:
            running.append(subprocess.Popen([sys.executable, "-m", "kvzoo.cli", "warmup", "--dtypes", pending.pop(0)]))
        finished = running.pop(0)
        failed += finished.wait() != 0
    print(
        f"kvzoo warmup: {len(groups)} groups of input dtypes in {min(jobs, len(groups))} processes, "
        f"{time.perf_counter() - start:.1f}s in all"
    )
    return 1 if failed else 0


def _audit(args: argparse.Namespace) -> int:
    from .auditing import CacheDumpError, audit, load_cache_dump, read_dump
    from .auditing.plot import require_matplotlib, scale_histograms

    if args.plot:
        try:
            require_matplotlib()
        except ImportError as missing:
            print(missing, file=sys.stderr)
            return 2
    try:
        dump = read_dump(load_cache_dump(args.file))
    except CacheDumpError as bad:
        print(f"kvzoo audit: {bad}", file=sys.stderr)
        return 2
    try:
        report = audit(
            dump,
            replay=args.replay,
            replay_impls=args.impl,
            seed=args.seed,
            outlier_ratio=args.outlier_ratio,
            max_findings=args.max_findings,
            impl=args.write_impl,
        )
    except ValueError as bad:
        print(f"kvzoo audit: {bad}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json(), indent=1) if args.json else report.format_text())
    if args.plot:
        written = scale_histograms(dump, args.plot)
        print(f"kvzoo audit: {len(written)} histograms in {args.plot}", file=sys.stderr)
    return 0 if report.ok else 1


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    from tabulate import tabulate

    print(tabulate(rows[1:], headers=rows[0], tablefmt="simple", disable_numparse=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvzoo", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvzoo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="implementations, platforms, modes, and why any is unavailable")
    check = sub.add_parser("check", help="run the conformance matrix on every available implementation")
    for command in (listing, check):
        command.add_argument("--json", action="store_true", help="print JSON (alone on stdout) instead of tables")
        command.add_argument(
            "--backend-module",
            action="append",
            metavar="MOD",
            help="also load backend module MOD, which exposes register(registry), "
            "for a backend that is not installed (repeatable)",
        )
    check.add_argument("--impl", action="append", help="only this implementation (repeatable)")
    check.add_argument(
        "--op", action="append", choices=["reshape_and_cache", "dequantize", "paged_attention", "golden"]
    )
    check.add_argument("--mode", action="append", help="only cases of this mode (repeatable; engine names too)")
    check.add_argument(
        "--interpret",
        action="store_true",
        help="also check the Triton kernels on CPU tensors under TRITON_INTERPRET=1 (slow)",
    )
    check.add_argument("--seed", type=int, help="the inputs' seed (default: KVZOO_SEED, else a fresh one, printed)")
    check.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failure")
    check.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    check.add_argument("-v", "--verbose", action="store_true", help="skip reasons, and tracebacks for failures")
    warm = sub.add_parser("warmup", help="compile the numba CPU kernels ahead of the first call (cached on disk)")
    warm.add_argument(
        "--jobs",
        "-j",
        type=int,
        default=1,
        help="processes compiling at once (each input-dtype width in its own: 2 halves the time on 2 cores)",
    )
    warm.add_argument("--dtypes", default=None, help="only these input dtypes, comma-separated (default: all)")
    audit = sub.add_parser(
        "audit",
        help="check a dumped paged cache (kvzoo.save_cache_dump): exit 1 on an error found, 2 if unreadable",
        description="Read a torch.save'd cache dump (README, 'Auditing a cache') and report what is wrong "
        "with it, where: exit status 1 when an error is found, 0 otherwise, 2 for a file it cannot read.",
    )
    audit.add_argument("file", help="the dump file")
    audit.add_argument("--json", action="store_true", help="print the report as JSON (findings, layers, summary)")
    audit.add_argument(
        "--replay",
        type=int,
        default=0,
        metavar="N",
        help="replay attention for N random query rows per sequence and layer on every available implementation",
    )
    audit.add_argument("--impl", action="append", help="replay only this implementation (repeatable)")
    audit.add_argument(
        "--write-impl",
        metavar="NAME",
        help="the write implementation that re-quantizes rows in the round trip (default: the fastest on the CPU; "
        "numpy avoids Numba's first compilation)",
    )
    audit.add_argument("--plot", metavar="DIR", help="write per-layer scale histograms (PNG) into DIR")
    audit.add_argument("--max-findings", type=int, default=100, help="findings listed per layer and kind")
    audit.add_argument(
        "--outlier-ratio", type=float, default=100.0, help="a scale this far from its head's median is a warning"
    )
    audit.add_argument("--seed", type=int, help="seed of the replay's positions and queries")
    args = parser.parse_args(argv)
    if getattr(args, "interpret", False):
        # Must be set before triton decorates the kernels, i.e. before the registry loads.
        os.environ["TRITON_INTERPRET"] = "1"
    return {"list": _list, "check": _check, "warmup": _warmup, "audit": _audit}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
