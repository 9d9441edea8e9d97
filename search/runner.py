"""Where evaluations run: in this process, a local process pool, or a Ray cluster.

All three return results in submission order (so answers never depend on the number of
workers) and report each one as it completes.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from stage_cosim.errors import UserError
from stage_cosim.search.evaluate import Evaluation

Job = tuple   # (a module-level function returning an Evaluation, its arguments…)
OnResult = Callable[[int, Evaluation], None]


def run_job(job: Job) -> Evaluation:
    return job[0](*job[1:])


class Runner(Protocol):
    def map(self, jobs: Sequence[Job], on_result: OnResult) -> list[Evaluation]: ...

    def close(self) -> None: ...


class SerialRunner:
    def map(self, jobs: Sequence[Job], on_result: OnResult) -> list[Evaluation]:
        out = []
        for i, job in enumerate(jobs):
            ev = run_job(job)
            on_result(i, ev)
            out.append(ev)
        return out

    def close(self) -> None:
        pass


class PoolRunner:
    """A local process pool (spawned workers: safe beside threads, same result as serial)."""

    def __init__(self, workers: int) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))

    def map(self, jobs: Sequence[Job], on_result: OnResult) -> list[Evaluation]:
        from concurrent.futures import as_completed

        futures = {self.pool.submit(run_job, job): i for i, job in enumerate(jobs)}
        out: list[Any] = [None] * len(jobs)
        try:
            for f in as_completed(futures):
                i = futures[f]
                out[i] = f.result()
                on_result(i, out[i])
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class RayRunner:
    """Evaluations as Ray tasks on a running cluster (``address``) or a local one (``auto``
    starts one when none is running)."""

    def __init__(self, address: str) -> None:
        try:
            import ray
        except ImportError:
            raise UserError("ray", "Ray is not installed (pip install 'stage-cosim[ray]')") from None
        self.ray = ray
        self.owned = False
        if not ray.is_initialized():
            try:
                ray.init(address=address if address != "auto" else None, ignore_reinit_error=True,
                         log_to_driver=False, include_dashboard=False)
            except (ConnectionError, ValueError, RuntimeError) as exc:
                raise UserError("ray", f"cannot connect to Ray at {address!r}: {exc}") from None
            self.owned = True
        self.task = ray.remote(run_job)

    def map(self, jobs: Sequence[Job], on_result: OnResult) -> list[Evaluation]:
        ray = self.ray
        refs = [self.task.remote(job) for job in jobs]
        index = {r: i for i, r in enumerate(refs)}
        out: list[Any] = [None] * len(jobs)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for r in done:
                i = index[r]
                out[i] = ray.get(r)
                on_result(i, out[i])
        return out

    def close(self) -> None:
        if self.owned:
            self.ray.shutdown()


def make_runner(workers: int, ray: str | None) -> Runner:
    if ray:
        return RayRunner(ray)
    if workers < 1:
        raise UserError("workers", f"must be at least 1, got {workers}")
    return PoolRunner(workers) if workers > 1 else SerialRunner()
