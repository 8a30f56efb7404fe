"""Fuzz: run many generated programs through the oracle (prediction == PyTorch).

    python tests/fuzz/run_programs.py                 # 50,000 programs, seeds 0..49999
    python tests/fuzz/run_programs.py --start 100000 --count 50000

Each program's every backward is predicted by ``versionwatch.check`` and then run
by PyTorch; the oracle asserts that both agree (fails or not, kind, versions)
and that the prediction changed no version and no ``.grad``. Prints a summary
and every mismatch (seed, then the program), and exits 1 if there was any.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oracle import Oracle
from programs import FORWARD_ERRORS, generate, run_program


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--count", type=int, default=50_000)
    args = p.parse_args()
    outcomes: Counter[str] = Counter()
    mismatches: list[tuple[int, str, str]] = []
    skipped = 0
    t0 = time.perf_counter()
    for seed in range(args.start, args.start + args.count):
        src = generate(seed)
        oracle = Oracle()
        try:
            for o in run_program(src, oracle, seed=seed):
                outcomes[o.kind or "ok"] += 1
        except AssertionError as e:
            mismatches.append((seed, str(e), src))
        except RuntimeError as e:
            if any(msg in str(e) for msg in FORWARD_ERRORS):
                skipped += 1  # the program itself is invalid PyTorch: not a prediction
            else:
                mismatches.append((seed, f"unexpected: {e}", src))
    dt = time.perf_counter() - t0
    print(f"{args.count} programs (seeds {args.start}..{args.start + args.count - 1}) in "
          f"{dt:.0f} s: backwards {dict(outcomes)}, skipped {skipped}, "
          f"mismatches {len(mismatches)}")
    for seed, err, src in mismatches[:20]:
        print(f"\n--- seed {seed}: {err}\n{src}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
