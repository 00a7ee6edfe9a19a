"""plan() on random architectures (issue 50, no silent wrong answer): outcome classes over many seeds and budgets.

    .venv/bin/python scripts/bench_random_arch.py [--seeds 120] [--start 0] [--fractions 0 0.5 1]
        [--time-limit 3] [--cost-model flops] [--max-minutes 20] [--out docs/results/random_arch.json]
        [--save-failing-plans DIR]

Each seed is one `tests/random_arch.random_model` (its grammar: that module's docstring); each budget is a fraction
of the way from planner.smallest_budget to eager's measured peak. A case passes when the planned step's loss,
outputs, gradients, buffers and the RNG state after it are torch.equal to eager's over two steps and its measured
peak (storage-tracking mode) is within the budget; plan() may also fail with a documented error (TraceError,
NoSolutionInTimeError, InfeasibleBudgetError naming a budget that then works). Everything else is a failure, grouped
here by class (the outcome and a normalised first line of what went wrong). The JSON holds every case (its
description, the budgets, the peaks, the exception's innermost project frames) and the table's classes; it is
rewritten after every seed, so a run stopped early keeps what it did. One torch thread.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tests.random_arch import ALLOWED, COST_MODEL, TIME_LIMIT_S, CaseResult, check_case, prepare  # noqa: E402


def failure_class(r: CaseResult) -> str:
    """The outcome and what went wrong with numbers, names and sizes taken out, so that like failures group."""
    detail = r.detail
    if r.outcome == "mismatch":
        m = re.match(r"(step \d+|eager step \d+ run twice|plan\(\) changed)[^:]*: (\w+(?: \w+)?)", detail)
        detail = f"{m.group(1)}: {m.group(2)}" if m else detail
        if "gradient of" in r.detail:
            detail = re.sub(r"gradient of \S+", "gradient", detail)
    elif r.outcome == "over_budget":
        detail = "predicted" if detail.startswith("predicted") else "measured"
    detail = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", detail)
    detail = re.sub(r"'[^']*'", "'X'", detail)
    return f"{r.outcome}: {detail[:160]}" if detail else r.outcome


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=120, help="how many seeds")
    ap.add_argument("--start", type=int, default=0, help="the first seed")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.5, 1.0],
                    help="budgets: fractions of the way from the smallest budget to eager's measured peak")
    ap.add_argument("--time-limit", type=float, default=TIME_LIMIT_S, help="seconds for each plan() and search")
    ap.add_argument("--cost-model", default=COST_MODEL)
    ap.add_argument("--max-minutes", type=float, default=None, help="stop starting seeds after this long")
    ap.add_argument("--out", default="docs/results/random_arch.json")
    ap.add_argument("--save-failing-plans", default=None, metavar="DIR",
                    help="write the plan of every failing case here (Plan.to_json), to replay its schedule")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    args.commit = _commit()  # the code the run imported: the checkout may move on while it runs
    results: list[CaseResult] = []
    t0 = time.perf_counter()
    seeds_done = 0
    for seed in range(args.start, args.start + args.seeds):
        if args.max_minutes is not None and time.perf_counter() - t0 > 60 * args.max_minutes:
            print(f"stopping after {seeds_done} seeds: --max-minutes {args.max_minutes:g} reached", flush=True)
            break
        pr = prepare(seed, time_limit_s=args.time_limit, cost_model=args.cost_model)
        for f in args.fractions:
            r = check_case(seed, f, prepared=pr, time_limit_s=args.time_limit, cost_model=args.cost_model,
                           save_failing_plan=args.save_failing_plans)
            results.append(r)
            line = f"seed {seed:4d} frac {f:.2f}: {r.outcome:12s} {r.seconds:5.1f} s {r.solver:28s} {r.detail[:110]}"
            print(line, flush=True)
        seeds_done += 1
        _write(out, args, results, seeds_done, time.perf_counter() - t0)
    classes = _classes(results)
    print(f"\n{len(results)} cases ({seeds_done} seeds x {len(args.fractions)} budgets) in "
          f"{time.perf_counter() - t0:.0f} s, cost model {args.cost_model}, time limit {args.time_limit:g} s\n")
    print("| outcome class | cases | seeds | example seeds |\n| --- | ---: | ---: | --- |")
    for c in classes:
        print(f"| {c['class']} | {c['cases']} | {len(c['seeds'])} | {', '.join(map(str, c['seeds'][:8]))} |")
    print(f"\nwritten to {out}")


def _classes(results: list[CaseResult]) -> list[dict]:
    groups: dict[str, list[CaseResult]] = defaultdict(list)
    for r in results:
        groups[failure_class(r) if r.outcome not in ("passed",) else "passed"].append(r)
    rows = []
    for name, rs in groups.items():
        seeds = sorted({r.seed for r in rs})
        rows.append({"class": name, "allowed": rs[0].outcome in ALLOWED, "cases": len(rs), "seeds": seeds,
                     "example": rs[0].summary() if rs[0].outcome != "passed" else ""})
    rows.sort(key=lambda c: (c["allowed"], -c["cases"]))
    return rows


def _commit() -> str | None:
    """The checkout's HEAD commit (with "+changes" where tracked files differ from it), None outside git."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty else "")


def _write(out: Path, args, results: list[CaseResult], seeds_done: int, seconds: float) -> None:
    counts: dict[str, int] = defaultdict(int)
    for r in results:
        counts[r.outcome] += 1
    notes: dict[str, list[int]] = defaultdict(list)
    for r in results:
        for n in r.notes:
            key = re.sub(r"\d+(\.\d+)?", "N", n)[:120]
            if r.seed not in notes[key]:
                notes[key].append(r.seed)
    doc = {
        "what": "plan() on tests/random_arch.py random architectures: planned step vs eager (torch.equal over two "
                "steps) and measured peak vs budget; see scripts/bench_random_arch.py",
        "torch": torch.__version__,
        "commit": args.commit,
        "cost_model": args.cost_model,
        "time_limit_s": args.time_limit,
        "fractions": args.fractions,
        "seeds": [args.start, args.start + seeds_done],
        "seconds": round(seconds, 1),
        "outcomes": dict(counts),
        "classes": _classes(results),
        "notes": {k: v for k, v in sorted(notes.items(), key=lambda kv: -len(kv[1]))},
    }
    # one line per case; a passed case's description is left out (random_model(seed) gives it again)
    cases = [asdict(r) | ({"description": ""} if r.outcome == "passed" else {}) for r in results]
    head = json.dumps(doc, indent=1, default=str)[:-2]
    body = ",\n  ".join(json.dumps(c, default=str) for c in cases)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(f'{head},\n "cases": [\n  {body}\n ]\n}}\n')
    tmp.replace(out)


if __name__ == "__main__":
    main()
