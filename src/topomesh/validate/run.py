"""``topomesh validate``: predict layouts on the ``local`` cluster, run them for real, compare.

For each layout: the simulator's step time and peak memory on the ``local`` cluster
(:func:`~topomesh.cost.cluster.local_cluster`: this CPU's spec, its gloo collective
profile, its measured op table), then a real run of the same model, layout and knobs
(:mod:`topomesh.validate.worker` on ``N`` processes started by ``topomesh launch
--standalone``), measured as that module says. Calibration happens once and is reused:

* collectives: the newest gloo profile ``topomesh calibrate`` saved for this host, or a
  fresh ``calibrate --local N`` sweep (N the largest world of the layouts) when there is
  none, the saved one measured fewer ranks or reduced its repeats otherwise than as means;
* ops: every distinct op of the layouts' traces not yet in the shared op-profile table for
  this CPU at ``threads`` threads (:func:`~topomesh.cost.ops.profile_ops`), the same
  fingerprint the prediction reads, so op times are measured under the thread count the
  real runs use; then, just before each layout's real run, its ops timed inside its replayed
  step (:func:`in_step_tables`), which price that layout instead, and its eager forward and
  backward on a fake group, whose time beyond (or short of) those ops prices their host work
  per op for that layout (:func:`~topomesh.sim.price.with_fb_host`).

:func:`compare` turns predictions and measurements into the report (relative errors, the
means, whether the predicted fastest layout is the measured fastest).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from topomesh.errors import LayoutError, TopomeshError

DEFAULT_LAYOUTS = ("dp_shard=1", "dp_replicate=2", "dp_shard=2", "tp=2", "pp=2", "tp=2,dp_shard=2")
"""One process; DDP-like replication (HSDP over a 1-wide shard), FSDP2, TP+SP, a two-stage
pipeline (several micro-batches: the global batch over one data-parallel rank), and TP × FSDP2
on four ranks."""


STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**40)}
"""glibc malloc settings for the real runs: every block up to 32 MiB (glibc's largest mmap
threshold on 64-bit) from the heap, and the heap never trimmed, so memory freed in one step is
reused in the next, as PyTorch's caching allocator keeps it on a GPU. With glibc's defaults
a one-process step of ``benchmarks/validate_llama.json`` took 5,600–12,800 page faults
(8–32 ms of system time, varying from step to step) that no op time or model includes; with
these, none. The op table's repeats already reuse their memory."""


class ValidateError(TopomeshError, RuntimeError):
    """A real run of a layout failed or produced no measurement."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LayoutResult:
    """One layout: predicted and measured step time (s) and peak memory (bytes, max over ranks)."""

    layout: str
    predicted_s: float
    measured_s: float
    predicted_peak_bytes: int
    measured_peak_bytes: int
    measured_cpu_s: float = 0.0
    """Median over the timed steps of the largest rank's CPU time (s): the step's cost apart
    from waiting for a core, for reading measurements taken on a machine others load."""
    page_faults: int = 0
    """Median over the timed steps of the most minor page faults a rank took in the step."""
    core_wait_s: float = 0.0
    """Median over the timed steps of the longest time a rank's stepping thread waited, ready,
    for a core (s; :func:`~topomesh.validate.worker.core_wait_ns`): the step's time lost to
    more runnable threads than cores."""
    steps_s: tuple[float, ...] = ()
    """Every timed step (s), slowest rank's."""
    world_size: int = 1
    microbatches: int = 1
    loadavg: tuple[float, ...] = ()
    """1-minute load average before and after the run (of each run, with ``--repeats``)."""
    breakdown: dict[str, Any] = field(default_factory=dict)
    runs_s: tuple[float, ...] = ()
    """Each real run's median step (s), in the order they ran (``--repeats``; one entry for one run)."""
    predicted_runs_s: tuple[float, ...] = ()
    """The prediction made just before each of those runs (s)."""

    @property
    def error(self) -> float:
        """(predicted − measured) / measured."""
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def memory_error(self) -> float:
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / self.measured_peak_bytes

    @property
    def spread(self) -> float | None:
        """Interquartile range of the timed steps over their median: how far one step moves
        from the next (None under two steps). Two processes on this 2-vCPU VM move ±10 %.

        >>> LayoutResult(layout="a", predicted_s=1, measured_s=3, predicted_peak_bytes=1,
        ...              measured_peak_bytes=1, steps_s=(5.0, 1.0, 4.0, 2.0, 3.0)).spread  # (4 - 2) / 3
        0.6666666666666666
        """
        if len(self.steps_s) < 2:
            return None
        q1, median, q3 = statistics.quantiles(self.steps_s, n=4, method="inclusive")
        return (q3 - q1) / median

    @property
    def runs_spread(self) -> float | None:
        """How far the real runs' medians lie apart, (largest - smallest) / their median (None
        under two runs): the same layout run again a few minutes later. An error below it is
        within what this host's speed moves by between runs; on the 2-vCPU EPYC VM of
        2026-11-27 the runs of one layout of the default set lay 4-34 % apart (three runs a
        layout, three validations).

        >>> round(LayoutResult(layout="a", predicted_s=1, measured_s=1, predicted_peak_bytes=1,
        ...                    measured_peak_bytes=1, runs_s=(0.26, 0.29, 0.25)).runs_spread, 4)  # 0.04 / 0.26
        0.1538
        """
        if len(self.runs_s) < 2:
            return None
        return (max(self.runs_s) - min(self.runs_s)) / statistics.median(self.runs_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout, "world_size": self.world_size, "microbatches": self.microbatches,
            "predicted_s": self.predicted_s, "measured_s": self.measured_s, "error": self.error,
            "predicted_peak_bytes": self.predicted_peak_bytes, "measured_peak_bytes": self.measured_peak_bytes,
            "memory_error": self.memory_error, "measured_cpu_s": self.measured_cpu_s, "page_faults": self.page_faults,
            "core_wait_s": self.core_wait_s,
            "cpu_error": (self.predicted_s - self.measured_cpu_s) / self.measured_cpu_s if self.measured_cpu_s else None,
            "steps_s": list(self.steps_s), "measured_spread": self.spread, "runs_spread": self.runs_spread,
            "loadavg": list(self.loadavg),
            "breakdown": self.breakdown, "measured_runs_s": list(self.runs_s),
            "predicted_runs_s": list(self.predicted_runs_s),
        }


def compare(results: Sequence[LayoutResult]) -> dict[str, Any]:
    """The report: per layout, mean and max absolute step-time error, whether the layout
    predicted fastest is the measured fastest, the largest absolute memory error, and the
    mean over layouts of how far their real runs lay apart (:attr:`LayoutResult.runs_spread`:
    the host's own noise, None with one run a layout).

    >>> r = [LayoutResult(layout="a", predicted_s=1.1, measured_s=1.0, predicted_peak_bytes=90,
    ...                   measured_peak_bytes=100),
    ...      LayoutResult(layout="b", predicted_s=0.5, measured_s=0.6, predicted_peak_bytes=50,
    ...                   measured_peak_bytes=50)]
    >>> out = compare(r)
    >>> round(out["mean_abs_error"], 4), round(out["max_abs_error"], 4), out["fastest_correct"]
    (0.1333, 0.1667, True)
    >>> out["max_abs_memory_error"], out["mean_runs_spread"]  # one run each: no spread
    (0.1, None)
    """
    if not results:
        raise LayoutError("validate needs at least one layout to compare.")
    errors = [abs(r.error) for r in results]
    spreads = [r.runs_spread for r in results if r.runs_spread is not None]
    predicted = min(results, key=lambda r: r.predicted_s)
    measured = min(results, key=lambda r: r.measured_s)
    return {
        "layouts": [r.to_dict() for r in results],
        "mean_abs_error": statistics.fmean(errors),
        "max_abs_error": max(errors),
        "fastest_predicted": predicted.layout,
        "fastest_measured": measured.layout,
        "fastest_correct": predicted.layout == measured.layout,
        "max_abs_memory_error": max(abs(r.memory_error) for r in results),
        "mean_runs_spread": statistics.fmean(spreads) if spreads else None,
    }


# ------------------------------------------------------------------ calibration


SWEEP_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
"""What validate's layouts issue: data and tensor parallel's reductions and gathers, context
and expert parallel's all-to-all, a pipeline's send/recv (everything but broadcast)."""
SWEEP_ARGV = ("--collectives", ",".join(SWEEP_COLLECTIVES), "--max-bytes", str(16 << 20),
              "--no-progress", "--backend", "gloo")
"""The sweep validate calibrates with: :data:`SWEEP_COLLECTIVES`, up to 16 MiB."""

POOL = 8
"""Sweeps the collective profile is fitted over when validate adds one before each pass
(``calibrate --pool``): this one and the newest seven saved. Three sweeps back to back here
fitted a 2-rank reduce-scatter 16-36 % apart and put two ranks' compute stretch at 1.06-1.30;
the mean over several launches narrows such spreads where they are the tail of one launch's
repeats. Four were too few for tensor parallel's hundreds of small collectives a step: 600
barrier-separated calls between two gloo ranks (2-vCPU Xeon) gave a mean of 0.45 ms for an
all-gather of 128 KiB (p99 4.3 ms) and 1.04 ms for a reduce-scatter of 128 KiB (p90 3.5 ms);
means of 80 of them (four sweeps' repeats) fell between 0.36-0.55 and 0.85-1.23 ms (p10-p90 of
4,000 draws), of 240 between 0.40-0.51 and 0.92-1.14. Two four-sweep profiles three sweeps
apart priced ``tp=2``'s forward and backward communication (``benchmarks/validate_llama.json``,
156 collectives) at 195 and 125 ms, where the collectives timed between its compute took
199-216 ms (``benchmarks/bench_collectives_in_step.py``; most of that miss was the compute
segment, :data:`~topomesh.cost.calibrate.COMPUTE_SEGMENT`). Eight sweeps (160 repeats a point)
cost no sweep more per pass: the older ones are read from the saved profile."""


def ensure_collectives(world: int, *, timeout_s: float = 900.0) -> Path:
    """The gloo profile of this host, calibrated now (one sweep of :func:`pooled_collectives`,
    not pooled) when none is saved, the newest measured fewer ranks than ``world`` or not every
    one of :data:`SWEEP_COLLECTIVES` (all-to-all before 2026-11-26: `cp` and `ep` layouts then
    stopped at pricing, "no model for all_to_all"), it reduced
    its repeats otherwise than :data:`~topomesh.cost.calibrate.STATISTIC` does (the median,
    before 2026-11-25), it has no compute stretch for ``world`` ranks (before 2026-11-25's
    last change, :func:`~topomesh.cost.calibrate.measure_compute_stretch`), its stretch and
    in-step costs were timed otherwise (:data:`~topomesh.cost.calibrate.COMPUTE_SEGMENT`: until
    2026-11-27 on subnormals, then each rank of the stretch from its own start), it has no
    pipeline hand-off (before 2026-12-07, :func:`~topomesh.cost.pipeline.measure_pipeline_handoff`),
    or its ranks were bound to CPUs (the real runs are not: :func:`_unbound`)."""
    from topomesh.cost.calibrate import COMPUTE_SEGMENT, STATISTIC, profile_directory
    from topomesh.cost.cluster import local_profile
    from topomesh.errors import ClusterError

    profile_directory()  # a cache directory we may not use is named here, not lost in a child's exit
    try:
        prof, path = local_profile()
        stretch = prof.meta.get("compute_stretch")
        swept = prof.meta.get("collectives")
        pipe = prof.meta.get("pipeline_action_s")
        if (int(prof.meta.get("world_size", 0)) >= world and prof.meta.get("statistic") == STATISTIC
                and isinstance(swept, list) and set(SWEEP_COLLECTIVES) <= set(swept)
                and isinstance(stretch, dict) and (world < 2 or str(world) in stretch)
                and prof.meta.get("compute_segment") == COMPUTE_SEGMENT
                and (world < 2 or (isinstance(pipe, dict) and "handoff_wait" in pipe))
                and _unbound(prof.meta.get("rank_cpus"))):
            return path
    except ClusterError:
        pass
    return pooled_collectives(world, pool=1, timeout_s=timeout_s)


def pooled_collectives(world: int, *, pool: int = POOL, timeout_s: float = 900.0) -> Path:
    """One more gloo sweep of this host (``calibrate --local world`` with :data:`SWEEP_ARGV`),
    the profile fitted over it and the newest ``pool`` - 1 sweeps saved before it that were
    measured the same way (:func:`~topomesh.cost.calibrate.pool_sweeps`)."""
    from topomesh.cost.calibrate import profile_directory, spawn_local

    profile_directory()  # a cache directory we may not use is named here, not lost in a child's exit
    result = spawn_local(max(2, world), [*SWEEP_ARGV, "--pool", str(pool)], timeout_s=timeout_s)
    return Path(result["profile"])


def _unbound(rank_cpus: Any) -> bool:
    """Whether a profile's ranks could run on every CPU we may use, as the real runs' ranks do
    (a profile from before 2026-11-26 does not record them: its ranks were spawned unbound).

    Bound ranks measure other collectives: two gloo ranks bound one to a CPU here took
    1.4-2.1 ms for a small all-gather against 0.7-1.1 ms unbound (a rank's calling thread and
    gloo's threads then take turns on one CPU). Binding the real runs as well was tried
    (2026-11-26): it settled the two-rank pipeline's waits for a core, but four ranks on the
    two CPUs, two bound to each, ran `tp=4` in 2.7 s against 3.5 s unbound and were predicted
    +28 % (bound calibration) and +35 % (unbound) off, `pp=4` -13 and -21 %.
    """
    from topomesh.topology.discover import allowed_cpus

    allowed = allowed_cpus()
    return rank_cpus is None or (isinstance(rank_cpus, list) and all(c == allowed for c in rank_cpus))


def profile_info(path: str | Path, now: float | None = None) -> dict[str, Any]:
    """Which collective profile priced the run and how old it was: its path, when it was
    measured (``meta.measured_at``) and the hours since (None where that is not a
    :data:`~topomesh.cost.calibrate.MEASURED_AT` time) and how many sweeps it pools. The ops
    are timed just before each run; the collectives come from this calibration, and on this VM
    two single-sweep calibrations an hour apart moved the TP and DP predictions by 3-8 %."""
    import calendar
    import time

    from topomesh.cost.calibrate import MEASURED_AT
    from topomesh.cost.collectives import load_profile

    meta = load_profile(path).meta
    at = meta.get("measured_at")
    sweeps = meta.get("sweeps")
    try:
        age = (time.time() if now is None else now) - calendar.timegm(time.strptime(str(at), MEASURED_AT))
    except ValueError:
        age = None
    return {"path": str(path), "measured_at": at, "age_h": None if age is None else round(age / 3600, 2),
            "sweeps": len(sweeps) if isinstance(sweeps, list) and sweeps else 1}


def ensure_ops(records: Sequence[Any], *, progress: Callable[[int, int, str], None] | None = None,
               device: str = "cpu", db: str | Path | None = None) -> dict:
    """Profile the distinct ops of ``records`` not yet measured on ``device`` (this CPU at the
    current thread count, or a GPU by its name) into ``db`` (default: the shared op-profile
    table); returns the op table for that fingerprint."""
    from topomesh.cost.devices import device_fingerprint
    from topomesh.cost.opdb import OpProfileDB
    from topomesh.cost.ops import profile_ops

    fp = device_fingerprint(device)
    with OpProfileDB(db) as store:
        profile_ops(records, store, device=device, fingerprint=fp, progress=progress)
        return store.table(fp)


def in_step_tables(model: str, seq_len: int | None, layouts: Sequence[tuple[str, Any]], training: Any, *,
                   threads: int, timeout_s: float = 900.0, copies: int = 1, replays: int = 1) -> dict[str, Any]:
    """Per layout text, the op times of its traced step replayed for real and its forward and
    backward's host work beyond them
    (:class:`topomesh.cost.instep.InStep`), measured in a child process under the real runs'
    thread count and malloc settings; the op times take precedence over the op table's isolated
    times.

    ``copies`` > 1: that many children replay at once and their figures are averaged
    (:func:`~topomesh.cost.instep.mean_in_step`). Where a layout's ranks outnumber the host's
    CPUs, each rank's ops run while the others' do, on cores and caches they take turns on:
    four replays of ``tp=2,dp_shard=2`` at once on this 2-vCPU host priced its compute 2-11 %
    above one alone (mean +7 %, eight replays in two trials), which the compute share (the
    cores' share, 2) does not hold.

    ``replays`` > 1: that many rounds of children one after another, all their figures
    averaged. A replay's figures move from one process to the next: eight of ``pp=2``
    (``benchmarks/validate_llama.json``) priced its step at 136-155 ms (standard deviation
    4 %), the same with 30 runs of the step per process as with 5, and a pass's prediction
    did not follow its run (``dp_shard=1``: 256 / 205 / 219 ms predicted in three passes,
    220 / 217 / 205 measured): the spread is the process's, and averaging processes narrows it."""
    from topomesh.cost.instep import mean_in_step, read_result
    from topomesh.layout.dims import Axis

    items = [{"text": text, "degrees": {a.value: lay.degree(a) for a in lay.order}, "order": lay.order_text()}
             for text, lay in layouts if lay.degree(Axis.CP) == 1]  # cp traces a GPU attention kernel
    if not items:
        return {}
    spec = {"model": model, "seq_len": seq_len, "threads": threads, "training": _knobs(training), "layouts": items}

    def replay(_: int) -> dict[str, Any]:
        return _run_child("timing the layouts' ops in their steps", spec, lambda tmp: ["-m", "topomesh.cost.instep"],
                          read_result, threads=threads, timeout_s=timeout_s)

    results: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max_workers=max(1, copies)) as pool:
        for _ in range(max(1, replays)):  # a round's children all at once, the rounds in turn
            results.extend(pool.map(replay, range(max(1, copies))))
    if len(results) == 1:
        return results[0]
    return {text: mean_in_step([r[text] for r in results]) for text in results[0]}


def _knobs(training: Any) -> dict[str, Any]:
    import dataclasses

    knobs = {f.name: getattr(training, f.name) for f in dataclasses.fields(training)}
    knobs["schedule"] = training.schedule.value
    return knobs


def _child_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **STEADY_MALLOC}


# ------------------------------------------------------------------ real runs


def worker_spec(model: str, seq_len: int | None, layout: Any, training: Any, *, steps: int, warmup: int,
                threads: int, device: str = "cpu") -> dict[str, Any]:
    """The spec :mod:`topomesh.validate.worker` reads for one real run of ``layout``."""
    degrees = {a.value: layout.degree(a) for a in layout.order}
    return {"model": model, "seq_len": seq_len, "degrees": degrees, "order": layout.order_text(),
            "threads": threads, "warmup": warmup, "steps": steps, "training": _knobs(training), "device": device}


def measure(model: str, seq_len: int | None, layout: Any, training: Any, *, steps: int, warmup: int,
            threads: int, device: str = "cpu", timeout_s: float = 900.0) -> dict[str, Any]:
    """Run ``layout`` for real (see :mod:`topomesh.validate.worker`) on ``device`` (``cpu``:
    gloo processes; ``cuda``: a GPU per rank, NCCL); rank 0's record."""
    spec = worker_spec(model, seq_len, layout, training, steps=steps, warmup=warmup, threads=threads, device=device)

    def argv(tmp: Path) -> list[str]:
        return ["-m", "topomesh", "launch", "--standalone", "--nproc-per-node", str(layout.world_size),
                "--log-dir", str(tmp / "logs"), "--topology", "off", "-m", "topomesh.validate.worker"]

    return _run_child(f"the real run of layout {layout.describe()}", spec, argv, lambda out: json.loads(out.read_text()),
                      threads=threads, timeout_s=timeout_s, hint="; give fewer --steps or a smaller model")


CRASH_RETRIES = 1
"""How many more times a child is run when a process of it was killed by a signal (a crash in
native code, not a Python error): gloo processes here died of glibc's ``malloc(): unaligned
tcache chunk detected`` (SIGABRT) or a segmentation fault, rarely, inside PyTorch's functional
collectives (once in about 80 functional-premium measurements, 2026-11-27), and one crash lost
the whole validation."""


def _run_child(what: str, spec: dict[str, Any], argv: Callable[[Path], list[str]], read: Callable[[Path], Any], *,
               threads: int, timeout_s: float, hint: str = "", retries: int = CRASH_RETRIES) -> Any:
    """Run ``python argv(tmp) --spec SPEC --out OUT`` in a private temporary directory with the
    real runs' environment (:func:`_child_env`); ``read(OUT)``, or a :class:`ValidateError`
    naming ``what`` with the child's last words. The child's ``topomesh: `` lines on stderr
    are passed on. A child one of whose processes was killed by a signal
    (:func:`~topomesh.cost.calibrate.died_of_signal`)
    runs again, up to ``retries`` times, and says so on stderr."""
    left = retries
    while True:
        try:
            return _run_child_once(what, spec, argv, read, threads=threads, timeout_s=timeout_s, hint=hint)
        except _Crashed as e:
            if left <= 0:
                raise ValidateError(str(e)) from None
            left -= 1
            print(f"topomesh: {what} crashed ({e.signal}); running it again", file=sys.stderr)


class _Crashed(Exception):
    """A child killed by a signal (:func:`_run_child` runs it again)."""

    def __init__(self, message: str, signal: str) -> None:
        super().__init__(message)
        self.signal = signal


def _run_child_once(what: str, spec: dict[str, Any], argv: Callable[[Path], list[str]], read: Callable[[Path], Any],
                    *, threads: int, timeout_s: float, hint: str) -> Any:
    """One run of :func:`_run_child`'s child; :class:`_Crashed` where a signal killed it."""
    with tempfile.TemporaryDirectory(prefix="topomesh-validate-") as tmp:
        spec_file, out_file = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_file.write_text(json.dumps(spec))
        cmd = [sys.executable, *argv(Path(tmp)), "--spec", str(spec_file), "--out", str(out_file)]
        try:
            proc = subprocess.run(cmd, env=_child_env(threads), capture_output=True, text=True, timeout=timeout_s,
                                  check=False)
        except subprocess.TimeoutExpired:
            raise ValidateError(f"{what} took more than {timeout_s:.0f} s{hint}.") from None
        if proc.returncode != 0 or not out_file.is_file():
            lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip() and "USDT" not in ln]
            causes = [ln for ln in lines if "Error" in ln or "terminate" in ln or "error:" in ln][:2]
            message = f"{what} failed (exit {proc.returncode}): " + " | ".join(causes + lines[-3:])
            from topomesh.cost.calibrate import died_of_signal

            killed = died_of_signal(proc.returncode, proc.stderr + proc.stdout)
            if killed:
                raise _Crashed(message, killed)
            raise ValidateError(message)
        for line in proc.stderr.splitlines():  # what the child has to say to the user (a fallback taken)
            if line.startswith("topomesh: "):
                print(line[:400], file=sys.stderr)
        return read(out_file)


def layout_result(spec_text: str, prediction: Any, record: dict[str, Any]) -> LayoutResult:
    """One :class:`LayoutResult` from a prediction (StepResult) and a worker record: the
    median of the timed steps, the largest rank's peak (:func:`pooled_result` of one run)."""
    return pooled_result(spec_text, [(prediction, record)])


def pooled_result(spec_text: str, passes: Sequence[tuple[Any, dict[str, Any]]]) -> LayoutResult:
    """One layout's :class:`LayoutResult` over one or several real runs (``--repeats``), each
    ``(prediction, worker record)`` with the prediction made just before its run.

    Measured: the median of every timed step of every run (and so for CPU time, page faults
    and the wait for a core); the peak (the largest rank's) of the middle run by peak. Predicted: the median
    prediction, as the steps' (the mean of the two middle ones for an even count), with the
    breakdown and memory of the lower middle one. A slow spell of the machine then moves one
    run's steps among several, not the whole measurement. The load average is kept from before
    and after every run. (Until 2026-11-27 an even count took the lower middle prediction:
    with ``--repeats 2`` the lower of two, against the median of both runs' steps, which put
    every such layout under its run by half the two passes' spread: 2-12 % here.)
    """
    if not passes:
        raise ValidateError(f"layout {spec_text} has no real run to report.")
    records = [rec for _, rec in passes]
    if any(not r["step_s"] for r in records):
        raise ValidateError(f"a real run of layout {spec_text} timed no steps.")
    steps = tuple(float(s) for r in records for s in r["step_s"])
    order = sorted(range(len(passes)), key=lambda i: passes[i][0].step_time_s)
    prediction = passes[order[(len(order) - 1) // 2]][0]
    return LayoutResult(
        layout=spec_text, predicted_s=statistics.median(p.step_time_s for p, _ in passes),
        measured_s=statistics.median(steps),
        predicted_peak_bytes=int(prediction.peak_memory_bytes),
        measured_peak_bytes=statistics.median_low(max(r["peak_bytes"]) for r in records),
        measured_cpu_s=statistics.median([s for r in records for s in r.get("cpu_s") or ()] or [0.0]),
        page_faults=int(statistics.median([s for r in records for s in r.get("page_faults") or ()] or [0])),
        core_wait_s=statistics.median([s for r in records for s in r.get("core_wait_s") or ()] or [0.0]),
        steps_s=steps, world_size=int(records[0]["world_size"]), microbatches=int(records[0]["microbatches"]),
        loadavg=tuple(x[0] for r in records for x in (r.get("loadavg_before"), r.get("loadavg_after")) if x),
        breakdown=prediction.breakdown.to_dict(),
        runs_s=tuple(statistics.median(r["step_s"]) for r in records),
        predicted_runs_s=tuple(p.step_time_s for p, _ in passes),
    )
