"""How OpenMP's waiting workers cost a computing role, colocated: a small matmul loop (64 x 256 by
256 x 256, twice, with a ReLU: ops the size of the demo's) on two threads, in a fresh process per
setting: one thread; two with GNU OpenMP's defaults; two passive (``OMP_WAIT_POLICY=PASSIVE``,
workers sleep after every op); and two passive with the short spin colocated roles get
(``GOMP_SPINCOUNT``, launch/runner.py). Rounds take turns, medians printed.

    python bench/omp_wait.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = """
import time, torch
x, w = torch.randn(64, 256), torch.randn(256, 256)
for _ in range(50):
    torch.relu(x @ w) @ w.T
started = time.perf_counter()
for _ in range(3000):
    torch.relu(x @ w) @ w.T
print((time.perf_counter() - started) / 3000 * 1e6)
"""


def main() -> None:
    from launch.runner import COLOCATED_SPINCOUNT

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    settings = {"1 thread": {"OMP_NUM_THREADS": "1"}, "2 threads": {"OMP_NUM_THREADS": "2"},
                "2 passive": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
                "2 colocated": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE",
                                "GOMP_SPINCOUNT": str(COLOCATED_SPINCOUNT)}}
    base = {key: value for key, value in os.environ.items() if key not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    times: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, env in settings.items():
            out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                                 check=True).stdout
            times[name].append(float(out))
    for name, values in times.items():
        print(f"{name:<12} {statistics.median(values):7.1f} us an iteration (rounds: "
              f"{', '.join(f'{v:.0f}' for v in values)})")
    print(f"colocated / passive: {statistics.median(times['2 colocated']) / statistics.median(times['2 passive']):.2f} "
          "(the short spin must win back what passive waits lose: < 1)")


if __name__ == "__main__":
    main()
