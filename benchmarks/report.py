"""Shared by the benchmark scripts: interleaved rounds, "median [min-max]" spreads, the machine a
run was measured on, the results file and one printed table per section.

Every reported timing is the median, with min-max, of at least ``MIN_ROUNDS`` rounds in which
the candidates take turns (A, B, A, B, ...), so that a slow spell of a shared machine lands on
all of them alike; a ratio is taken per round, then its median [min-max]. ``--rounds N`` below
``MIN_ROUNDS`` is a quick check: the results file then says how many rounds it had.
"""

import datetime
import json
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TypeVar

from rich.console import Console
from rich.table import Table

MIN_ROUNDS = 5
_LOAD_BEFORE = os.getloadavg()  # when the script imported this module: before it measured
T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


def results_path(name: str) -> pathlib.Path:
    """Where a script writes its results file ``name``: ``benchmarks/results/``, or the folder
    in ``$BENCH_RESULTS_DIR`` when set (a quick check's numbers kept apart from the recorded
    ones).

    >>> results_path("x.json").name
    'x.json'
    """
    folder = os.environ.get("BENCH_RESULTS_DIR")
    return pathlib.Path(folder or pathlib.Path(__file__).parent / "results") / name


def interleaved(
    candidates: Mapping[K, Callable[[], T]], rounds: int = MIN_ROUNDS
) -> dict[K, list[T]]:
    """Calls every candidate once per round, in turn (A, B, A, B, ...), for ``rounds`` rounds,
    and returns each one's samples (what its calls returned), by name.

    >>> interleaved({"a": lambda: 1.0, "b": lambda: 2.0}, rounds=2)
    {'a': [1.0, 1.0], 'b': [2.0, 2.0]}
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    samples: dict[K, list[T]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, candidate in candidates.items():
            samples[name].append(candidate())
    return samples


def per_call(
    fn: Callable[[], object], calls: int = 1, wait: Callable[[object], object] = lambda out: out
) -> Callable[[], float]:
    """A candidate for :func:`interleaved`: each call of it times ``calls`` calls of ``fn``, the
    last one's result passed to ``wait`` (``jax.block_until_ready``), and returns seconds per
    call.

    >>> seconds = per_call(lambda: sum(range(100)), calls=10)()
    >>> 0 < seconds < 1
    True
    """

    def timed() -> float:
        start, out = time.perf_counter(), None
        for _ in range(calls):
            out = fn()
        wait(out)
        return (time.perf_counter() - start) / calls

    return timed


def own_results(out: object) -> None:
    """Waits for the shards this process holds of the arrays in ``out`` (a step's results in a
    run of several processes, where some arrays lie on other processes' devices): ``wait`` for
    :func:`per_call` there.

    Example::

        seconds = per_call(lambda: step(model, x), calls=10, wait=own_results)()
    """
    import jax  # only where a process measures: the parent process of a run never starts JAX

    arrays = [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)]
    jax.block_until_ready([s.data for x in arrays for s in x.addressable_shards])


def spread(samples: Sequence[float], scale: float = 1.0, digits: int = 2) -> str:
    """``samples`` (times ``scale``) as "median [min-max]".

    >>> spread([0.3, 0.1, 0.2], scale=1e3, digits=0)
    '200 [100-300]'
    """
    values = [v * scale for v in samples]
    med, low, high = statistics.median(values), min(values), max(values)
    return f"{med:.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]"


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Each round's ratio ``numerators[i] / denominators[i]``.

    >>> ratios([2.0, 3.0], [1.0, 2.0])
    [2.0, 1.5]
    """
    return [a / b for a, b in zip(numerators, denominators, strict=True)]


def ratio_spread(numerators: Sequence[float], denominators: Sequence[float], digits=2) -> str:
    """The per-round ratios of ``numerators`` to ``denominators`` as "median [min-max]".

    >>> ratio_spread([2.0, 3.0, 4.0], [1.0, 2.0, 2.0])
    '2.00 [1.50-2.00]'
    """
    return spread(ratios(numerators, denominators), digits=digits)


def median(samples: Sequence[float]) -> float:
    """The median of ``samples`` (what a target is checked against).

    >>> median([3.0, 1.0, 2.0])
    2.0
    """
    return statistics.median(samples)


def speed_probe(repeats: int = 3) -> float:
    """Seconds of a fixed workload, the median of ``repeats``: a pure-Python loop and XLA
    compiling a small fixed program (a 4-layer MLP's value and gradient, a new function each
    time, so nothing comes from JAX's caches): how fast this machine ran when a results file
    was written. On this 2-core machine the same one-device compile took 1.5-2x longer on one
    day than on the day before, which ratios taken in the same rounds absorb and absolute
    numbers do not; this says which day was slow.

    >>> 0 < speed_probe(1) < 60
    True
    """
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    def program():
        def loss(ws, x):
            for w in ws:
                x = jnp.tanh(x @ w)
            return (x * x).mean()

        return jax.jit(jax.value_and_grad(loss))

    args = ([jnp.ones((64, 64))] * 4, jnp.ones((8, 64)))
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        total = 0
        for i in range(1_000_000):
            total += i & 7
        program().lower(*args).compile()
        seconds.append(time.perf_counter() - start)
    return round(statistics.median(seconds), 3)


def machine() -> dict:
    """What a run was measured on, no host name: cores, the 1-minute load average when the script
    started and now, the CPU model, and the seconds of :func:`speed_probe` now.

    >>> sorted(machine())
    ['cores', 'cpu', 'load average after', 'load average before', 'speed probe s']
    """
    cpu = "unknown"
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "load average before": round(_LOAD_BEFORE[0], 2),
        "load average after": round(os.getloadavg()[0], 2),
        "cpu": cpu,
        "speed probe s": speed_probe(),
    }


def rounds_option(argv: list[str]) -> int:
    """The number after ``--rounds`` on a command line, else ``MIN_ROUNDS``; below it only for a
    quick check (the results file says how many).

    >>> rounds_option(["x.py", "--rounds", "2"]), rounds_option(["x.py"])
    (2, 5)

    ``--help`` (or ``-h``) prints the running benchmark's docstring and exits instead.
    """
    if "--help" in argv or "-h" in argv:
        print(sys.modules["__main__"].__doc__ or "see the benchmark's source")
        raise SystemExit(0)
    if "--rounds" not in argv:
        return MIN_ROUNDS
    at = argv.index("--rounds") + 1
    try:
        rounds = int(argv[at])
    except (IndexError, ValueError):
        raise SystemExit("--rounds needs a whole number of rounds, e.g. --rounds 5") from None
    if rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {rounds}")
    return rounds


def record_run(results: dict, sections: Sequence[str], rounds: int | str) -> None:
    """Records in ``results["measured"]``, for each of ``sections``, the machine, the date and
    ``rounds`` (the others' records, from earlier runs, stay)."""
    run = {"date": datetime.date.today().isoformat(), "rounds": rounds, **machine()}
    if isinstance(rounds, int) and rounds < MIN_ROUNDS:
        run["note"] = f"quick check: {rounds} round(s), fewer than {MIN_ROUNDS}"
    measured = results.setdefault("measured", {})
    for name in sections:
        measured[name] = run


def publish(
    results: dict, path: pathlib.Path, title: str, sections: tuple[str, ...], rounds: int | str
) -> None:
    """Records the machine and ``rounds`` for ``sections`` (:func:`record_run`), writes
    ``results`` as JSON to ``path`` and prints each section as a measure/value table."""
    record_run(results, sections, rounds)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    console = Console()
    for name in sections:
        table = Table(title=f"{title}: {name}")
        table.add_column("measure")
        table.add_column("value", justify="right")
        for k, v in results[name].items():
            table.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
        console.print(table)
    console.print(f"measured on: {results['measured'][sections[0]]}" if sections else "")
    console.print(f"written to {path}")


def run_sections(
    sections: dict[str, Callable[[int], dict]],
    path: pathlib.Path,
    title: str,
    only: list[str] | None = None,
    device: str = "",
    rounds: int = MIN_ROUNDS,
) -> None:
    """Runs every section (called with ``rounds``), or those named in ``only`` (their results
    then replace theirs in the file at ``path``, the others kept), and publishes them with
    ``device`` beside."""
    names = only or list(sections)
    unknown = set(names) - set(sections)
    if unknown:
        raise SystemExit(f"unknown section(s) {sorted(unknown)}; known: {list(sections)}")
    results = json.loads(path.read_text()) if only and path.exists() else {}
    for name in names:
        results[name] = sections[name](rounds)
    results["device"] = device
    publish(results, path, title, tuple(names), rounds)


def only_sections(argv: list[str]) -> list[str] | None:
    """The section names after ``--only`` on a command line (up to the next ``--`` option),
    else ``None`` (every section).

    >>> only_sections(["x.py", "--only", "a", "b", "--rounds", "1"])
    ['a', 'b']
    """
    if "--only" not in argv:
        return None
    names = []
    for arg in argv[argv.index("--only") + 1 :]:
        if arg.startswith("--"):
            break
        names.append(arg)
    return names
