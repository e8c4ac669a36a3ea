"""Where the runs of a sweep execute: local processes (one per GPU, or CPU workers) or a Dask cluster."""

from __future__ import annotations

import dataclasses
import os
import queue
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed

from .grid import Run, SweepError
from .run import ABORT, STOP_GRACE_S, Outcome, Task, execute


GPU_RESOURCE = "GPU"


# ----------------------------------------------------------------------------- executors


def _visible_gpus() -> list[str]:
    """CUDA device ids this process sees, as ``CUDA_VISIBLE_DEVICES`` entries; [] when forced to the interpreter."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return []
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"],
        capture_output=True, text=True,
    )
    count = int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return listed[:count] if "CUDA_VISIBLE_DEVICES" in os.environ else [str(i) for i in range(count)]


def local_slots(workers: int | None) -> list[dict]:
    """The environment of each local worker: one GPU each, or a share of the CPU cores."""
    gpus = _visible_gpus()
    if gpus:
        if workers is not None and workers > len(gpus):
            raise SweepError(f"--workers {workers}: only {len(gpus)} GPU(s) are visible, and each local worker owns one")
        return [{"CUDA_VISIBLE_DEVICES": gpu} for gpu in gpus[: workers or len(gpus)]]
    workers = workers or 1
    slot = {"TRITON_INTERPRET": "1"}
    if "OMP_NUM_THREADS" not in os.environ:
        slot["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    return [dict(slot) for _ in range(workers)]


def run_local(tasks: dict[Run, Task], slots: list[dict]):
    """Yield ``(run, outcome)`` as runs finish, at most one run per worker slot (``local_slots``) at a time."""
    free: queue.Queue = queue.Queue()
    for slot in slots:
        free.put(slot)

    def pinned(task: Task) -> Outcome:
        slot = free.get()
        try:
            return execute(dataclasses.replace(task, env={**task.env, **slot}))
        finally:
            free.put(slot)

    pool = ThreadPoolExecutor(max_workers=len(slots))
    try:
        futures = {pool.submit(pinned, task): run for run, task in tasks.items()}
        for future in as_completed(futures):
            yield futures[future], future.result()
    except BaseException:  # interrupted (or the consumer stopped): runs in flight end now, with their kernels
        ABORT.set()
        raise
    finally:  # start no further run; wait for the runs in flight to end, however often Ctrl-C is pressed meanwhile
        _wait_uninterrupted(lambda: pool.shutdown(wait=True, cancel_futures=True))


def _wait_uninterrupted(wait) -> None:
    """Call ``wait()`` to its end: a KeyboardInterrupt (or SIGTERM) meanwhile calls it again, and is raised after it."""
    interrupted = None
    while True:
        try:
            wait()
            break
        except KeyboardInterrupt as exc:
            interrupted = interrupted or exc
            print("kvlab.sweep: stopping: ending the runs in flight and their kernels "
                  f"(at most {STOP_GRACE_S} s)", file=sys.stderr, flush=True)
    if interrupted is not None:
        raise interrupted


def connect_dask(address: str):
    try:
        from distributed import Client
    except ImportError:
        raise SweepError("--executor dask needs the distributed package (pip install distributed)") from None
    try:
        client = Client(address, timeout=30)
    except Exception as exc:  # unreachable, or not an address at all (ValueError, TypeError, ...)
        raise SweepError(f"--address {address}: cannot reach a Dask scheduler there; give a scheduler's address "
                         f"such as tcp://host:8786 ({type(exc).__name__}: {exc})") from None
    workers = client.scheduler_info().get("workers", {})
    if not any(w.get("resources", {}).get(GPU_RESOURCE, 0) >= 1 for w in workers.values()):
        client.close()
        raise SweepError(
            f"--address {address}: no worker declares the resource {GPU_RESOURCE} (each run asks for "
            f"{GPU_RESOURCE}=1); start workers with `--resources {GPU_RESOURCE}=1`"
        )
    return client


def run_dask(tasks: dict[Run, Task], client):
    """Yield ``(run, outcome)`` as the cluster finishes runs; each task asks for one GPU resource."""
    from distributed import as_completed as dask_completed

    futures = {}
    for run, task in tasks.items():
        future = client.submit(execute, task, resources={GPU_RESOURCE: 1}, pure=False,
                               key=f"kvlab-sweep-{run.key}-{os.urandom(4).hex()}")
        futures[future] = run
    try:
        for future in dask_completed(list(futures)):
            run = futures[future]
            try:
                yield run, future.result()
            except Exception as exc:  # the task itself died (worker lost, unpicklable result, ...)
                yield run, Outcome(False, 0.0, f"the Dask task failed: {type(exc).__name__}: {exc}", None)
    finally:
        client.cancel(list(futures))
