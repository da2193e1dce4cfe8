"""torch's own DataLoader test suite, run against torch and against gpuload.DataLoader.

Runs torch's ``test/test_dataloader.py`` under pytest in up to three ways, in every process the
suite starts (``swap/sitecustomize.py``: spawned and forkserver workers and subprocesses
included, checked before each run):

- ``torch``: as is, the baseline;
- ``gpuload``: ``torch.utils.data.DataLoader`` and ``torch.utils.data.dataloader.DataLoader``
  replaced by ``gpuload.DataLoader`` (the global swap: the acceptance run of issue #11);
- ``gpuload-import``: only the suite module's own name ``DataLoader`` replaced, as changing
  the import line does (a few tests that call ``torch.utils.data.DataLoader(...)`` by its full
  name still get torch's class there).

Prints passed/failed/skipped for each and every test that passes for torch but not for a
gpuload run, with its first error line.

torch's test file is not part of this repository. Put the one matching the installed torch at
``benchmarks/torch_suite/upstream/test_dataloader.py`` (or pass ``--suite``); the results in
the README come from pytorch/pytorch commit 74436f9025609987bbc69c617564f98635b67807.

Usage: python benchmarks/torch_suite/run.py [--only MODE ...] [-k EXPR] [--timeout S]
       python benchmarks/torch_suite/run.py --compare   (re-print the last saved results)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SWAP_DIR = HERE / "swap"
DEFAULT_SUITE = HERE / "upstream" / "test_dataloader.py"
DEFAULT_OUT = HERE / "results"
MODES = ("torch", "gpuload", "gpuload-import")
SWAPS = {"torch": "", "gpuload": "global", "gpuload-import": "import"}  # GPULOAD_TORCH_SUITE_SWAP
PASSING = ("passed", "xfailed")  # unittest's expectedFailure shows as xfailed under pytest

def suite_env(mode: str, report: Path) -> dict[str, str]:
    """The environment of one run: the swap folder and the repo first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(SWAP_DIR), str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env["GPULOAD_TORCH_SUITE_SWAP"] = SWAPS[mode]
    env["GPULOAD_TORCH_SUITE_REPORT"] = str(report)
    env.pop("PYTORCH_TEST_WITH_SLOW", None)  # torch's @slowTest tests stay skipped, as in torch's default run
    return env


def check_swap(env: dict[str, str], suite: Path) -> None:
    """Fail loudly unless every start method's child process gets gpuload's class."""
    done = subprocess.run([sys.executable, str(SWAP_DIR / "check_swap.py"), str(suite.parent)], env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        sys.exit(f"the DataLoader swap does not reach every process:\n{done.stdout}{done.stderr}")


def run_suite(mode: str, suite: Path, out: Path, keyword: str | None, timeout: float) -> dict[str, dict]:
    """Run the suite in one mode; returns {test id: {"outcome", "why", "seconds"}}."""
    report = out / f"{mode}.jsonl"
    env = suite_env(mode, report)
    if SWAPS[mode]:
        check_swap(env, suite)
    command = [
        # --tb=native: pytest's own traceback formatting crashes the session (INTERNALERROR) on a
        # RecursionError's traceback, which gpuload's global swap raises today.
        sys.executable, "-m", "pytest", str(suite), "-q", "--tb=native", "-p", "no:cacheprovider",
        "-p", "torch_suite_report",
        "-c", str(HERE / "pytest.ini"), "--rootdir", str(suite.parent),
    ]
    if keyword:
        command += ["-k", keyword]
    started = time.monotonic()
    log = out / f"{mode}.log"
    with open(log, "w") as log_file:
        # Its own session, so that a time-out ends the suite's workers and subprocesses too.
        pytest_run = subprocess.Popen(command, env=env, cwd=suite.parent, stdout=log_file,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        try:
            pytest_run.wait(timeout)
            stopped = ""
        except subprocess.TimeoutExpired:
            os.killpg(pytest_run.pid, signal.SIGKILL)
            pytest_run.wait()
            stopped = f" (stopped after {timeout:.0f} s: the tests after the last one listed did not run)"
    print(f"{mode}: ran in {time.monotonic() - started:.0f} s{stopped}; pytest output in {log}", flush=True)
    check_suite_loader(mode, report)
    return read_report(report)


def check_suite_loader(mode: str, report: Path) -> None:
    """Fail loudly unless the suite's tests got the class this mode is about."""
    classes = next((json.loads(line) for line in report.read_text().splitlines() if '"suite_loader"' in line), {})
    expected = "gpuload.loader.DataLoader" if SWAPS[mode] else "torch.utils.data.dataloader.DataLoader"
    if classes.get("suite_loader") != expected:
        sys.exit(f"{mode}: the suite's tests got {classes.get('suite_loader')}, not {expected} ({report})")


def read_report(report: Path) -> dict[str, dict]:
    """Per test, the phase that decided it: a failing setup/call/teardown wins over a pass."""
    results: dict[str, dict] = {}
    if not report.exists():
        return results
    for line in report.read_text().splitlines():
        entry = json.loads(line)
        if "test" not in entry:
            continue
        earlier = results.get(entry["test"])
        if earlier is None or earlier["outcome"] in PASSING + ("skipped",):
            results[entry["test"]] = entry
    return results


def counts(results: dict[str, dict]) -> str:
    tally = Counter(entry["outcome"] for entry in results.values())
    main = [f"{tally.pop(name, 0)} {name}" for name in ("passed", "failed", "skipped")]
    return ", ".join(main + [f"{n} {name}" for name, n in sorted(tally.items())])


def regressions(baseline: dict[str, dict], candidate: dict[str, dict]) -> list[tuple[str, str, str]]:
    """Tests that pass for torch but not for gpuload: (test, gpuload's outcome, first error line)."""
    lost = []
    for test, entry in baseline.items():
        if entry["outcome"] not in PASSING:
            continue
        other = candidate.get(test, {"outcome": "not run", "why": "did not finish within the time limit"})
        if other["outcome"] not in PASSING:
            lost.append((test, other["outcome"], other["why"]))
    return lost


def print_summary(results: dict[str, dict[str, dict]]) -> int:
    for mode in MODES:
        if mode in results:
            print(f"{mode:15s} {counts(results[mode])}")
    lost_any = False
    for mode in MODES[1:]:
        if "torch" not in results or mode not in results:
            continue
        lost = regressions(results["torch"], results[mode])
        lost_any = lost_any or bool(lost)
        print(f"\n{len(lost)} tests pass for torch but not for {mode}:")
        for test, outcome, why in lost:
            shown = why if len(why) <= 240 else f"{why[:160]} ... {why[-70:]}"  # the end names the cause
            print(f"  {test.split('::', 1)[-1]}  [{outcome}]  {shown}")
    return 1 if lost_any else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", type=Path, default=DEFAULT_SUITE, help="torch's test_dataloader.py")
    parser.add_argument("--only", choices=MODES, nargs="+", help="run these only (the others are read from --out)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression: run a subset")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run (default 1800)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the results and logs go")
    parser.add_argument("--compare", action="store_true", help="print the saved results without running")
    args = parser.parse_args()

    suite = args.suite.resolve()
    if not args.compare and not suite.is_file():
        sys.exit(f"{suite} is missing: put torch's test/test_dataloader.py for torch "
                 f"{_torch_version()} there (see the README, section \"torch's own tests\")")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for mode in MODES:
        if args.compare or (args.only and mode not in args.only):
            saved = read_report(args.out / f"{mode}.jsonl")
            if saved:
                results[mode] = saved
            continue
        results[mode] = run_suite(mode, suite, args.out, args.keyword, args.timeout)
    return print_summary(results)


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    sys.exit(main())
