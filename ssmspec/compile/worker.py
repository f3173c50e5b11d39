"""Worker processes of `StepCompiler.ahead` (ssmspec.compile.lower): each compiles recorded steps, written to job
files by the process that recorded them, into Inductor's on-disk cache, where that process loads them.

    python -m ssmspec.compile.worker [--threads N]    # job files on stdin, one a line; "ok JOB" or "failed JOB" out

A job's failure is written to stderr and answered "failed": the recording process then compiles that step itself.
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch

from ssmspec.compile import lower


def compile_job(path: str) -> None:
    """Compile the step in job file `path` (torch.save of its graph's data, its inputs and Inductor settings)."""
    job = torch.load(path, weights_only=False)  # (written by the parent process, from its own recording)
    lower.compile_step(lower.graph_from_data(job["graph"]), job["inputs"], job["options"], kernels=job["kernels"])


def main(argv: list[str] | None = None) -> int:
    """Compile each job file read from stdin, answering a line for each."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="the recording process's threads (the code is for them)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for line in sys.stdin:
        path = line.strip()
        if not path:
            continue
        try:
            compile_job(path)
            status = "ok"
        except Exception:  # noqa: BLE001 - any failure: the parent compiles the step itself, and says why there
            traceback.print_exc()
            status = "failed"
        print(status, path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
