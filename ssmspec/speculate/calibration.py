"""Calibration: what a verify step costs on the running model, measured on it, per batch size and device: the verify
cost of each tree size relative to a plain step (the curve the adaptive policy prices depths with), which linears pay
per tree size (oneDNN's packed weights or F.linear, where the runner may choose) and which path one-node steps take
(HF's decode path or the tree path and a commit).

Each measurement is one forward of a chain of zeros on the runner's committed state, rolled back (nothing changes);
the sizes and ways take turns, one warm-up run then REPEATS timed runs each, and each keeps its fastest run (load from
other processes only ever adds time). It is bounded: greedy calls spend at most SHARE of their steps' time on it (the
first call at most SHARE of its own), between steps, the most useful measurements first (a plain step, the largest
tree, then the sizes between), and what is not measured yet is priced by interpolation and a prior. What was measured
accumulates across calls on the model (`Calibration`, kept on it per batch size and device: nothing process-wide) and
on disk per model and machine (`CALIBRATION_DIR`, beside the user's cache: a later process starts calibrated). A call
that samples, or a model under tensor parallelism, completes the calibration before its first step instead: a seeded
sampling call draws the same tokens whatever ran before, and every process of a sharded model must take the same
decisions; `ssmspec.calibrate` completes it on demand (a server at start-up, a compiled model's warm-up).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from ssmspec._version import __version__
from ssmspec.compiled import compiled_as
from ssmspec.speculate.step import Runner
from ssmspec.tree import TokenTree

# the tree sizes whose verify cost is measured (powers of two up to the largest a call can verify, and that one, up to
# LARGEST_MEASURED: larger trees are priced on the slope of the largest two measured)
COST_SIZES = (1, 2, 4, 8, 16, 32)
LARGEST_MEASURED = 64
REPEATS = 3  # timed runs per size and way (after one warm-up run)
SHARE = 0.08  # of a greedy call's steps' time, what measuring may take in that call
# until a size is measured: relative cost per node beyond the root at batch 1, growing with the batch as batch**0.6
# (the embedded target on a 2-core CPU: 25 nodes cost 1.64 plain steps at batch 1, 2.3 at batch 4, 4.6 at 16; a prior
# on the cheap side let the first calls at batch 16 try trees that cost twice what it priced)
PRIOR_SLOPE = 0.03
# the environment variable naming the directory calibrations are kept in ("off": none); default beside the user's
# other caches: $XDG_CACHE_HOME/ssmspec, else ~/.cache/ssmspec
CALIBRATION_DIR = "SSMSPEC_CACHE"
FORMAT = 1  # of the files written there


class Calibration:
    """What verifying costs for one model, batch size and device (see the module docstring).

    Args:
        ways: the linears' ways a size is timed in: (True, False) packed and F.linear where the runner may choose
            (`chooses_packing`), else (None,) (the runner's own).
        paths: the paths a one-node step is timed on: (True, False) HF's decode path and the tree path where the
            runner may choose, else (None,).
        batch: the batch size (the prior's slope grows with it).
    """

    def __init__(self, ways: Sequence = (None,), paths: Sequence = (None,), batch: int = 1) -> None:
        self.ways = tuple(ways)
        self.paths = tuple(paths)
        self.batch = batch
        self.sizes: set[int] = {1}
        self.best: dict[tuple, float] = {}  # item -> its fastest timed run (seconds)
        self.runs: dict[tuple, int] = {}  # item -> runs so far (the first one warms up)
        self.spent = 0.0  # seconds spent measuring, every call together
        self.earned = 0.0  # SHARE of the steps' seconds of the calls on this model and key (this process)
        self.between = 0.0  # what measuring between steps took of it
        self.fixed: tuple[dict[int, float], float | None] | None = None  # `fix`'s curve and seconds: nothing measured
        self.out_of_memory: int | None = None  # the smallest size whose measurement ran out of memory (this process)
        self._complete = False  # `complete`, once found

    # ------------------------------------------------------------------ what is known
    def want(self, sizes: Sequence[int]) -> None:
        """Sizes a call may verify (a later call with larger trees adds its own)."""
        new = {int(n) for n in sizes} - self.sizes
        if new:
            self.sizes.update(new)
            self._complete = False

    def items(self) -> list[tuple]:
        """Every measurement: ("node", path, way) for a one-node step, ("size", n, way) for an n-node chain."""
        nodes = [("node", path, way) for path in self.paths for way in self.ways]
        return nodes + [("size", n, way) for n in sorted(self.sizes) if n > 1 for way in self.ways]

    @property
    def complete(self) -> bool:
        """Whether every size the calls asked for is measured in every way, REPEATS times (once true, kept until a
        call asks for another size: read after every step)."""
        if not self._complete:
            self._complete = self.fixed is not None or all(self.runs.get(i, 0) > REPEATS for i in self.items())
        return self._complete

    def _best(self, kind: str, key) -> tuple[float, object] | None:
        """(seconds, way) of the fastest measured way of a one-node path (`key`: the path) or a size."""
        found = [(self.best[(kind, key, way)], way) for way in self.ways if (kind, key, way) in self.best]
        return min(found, key=lambda x: x[0]) if found else None

    def single_node_path(self) -> bool | None:
        """Whether one-node steps should take HF's decode path (True) or the tree path (False): the tree path only
        where it measured clearly cheaper (by 5%); None where not measured (or not the runner's to choose)."""
        if self.paths == (None,):
            return None
        decode, tree = self._best("node", True), self._best("node", False)
        if decode is None:
            return None
        return not (tree is not None and tree[0] < 0.95 * decode[0])

    def _plain_path(self):
        """The one-node path plain steps take: the one measured faster (until measured the tree path, verified in
        place: on the embedded target 4.3 ms against HF's decode path's 5.7 at batch 4, 10.5 against 16.4 at batch
        32), or None where the runner does not choose."""
        if self.paths == (None,):
            return None
        path = self.single_node_path()
        return False if path is None else path

    def decode_seconds(self) -> float | None:
        """A plain step's seconds (its forward and commit) on the path and way chosen; None before it is measured."""
        if self.fixed is not None:
            return self.fixed[1]
        best = self._best("node", self._plain_path())
        return best[0] if best is not None else None

    def packed_sizes(self) -> dict[int, bool] | None:
        """Per measured size, whether packed linears measured faster (ssmspec.linear.packs reads it); None where the
        runner does not choose."""
        if self.ways == (None,):
            return None
        out = {}
        one = self._best("node", self._plain_path())
        if one is not None:
            out[1] = bool(one[1])
        for n in sorted(self.sizes - {1}):
            best = self._best("size", n)
            if best is not None:
                out[n] = bool(best[1])
        return out or None

    def curve(self) -> dict[int, float]:
        """Verify cost per size relative to a plain step, non-decreasing: measured sizes as measured, the others
        interpolated between them, or beyond the largest measured one (or before any) on the prior's slope."""
        if self.fixed is not None:
            return dict(self.fixed[0])
        base = self.decode_seconds()
        measured = {1: 1.0}
        if base:
            for n in sorted(self.sizes - {1}):
                best = self._best("size", n)
                if best is not None:
                    measured[n] = best[0] / base
        slope = PRIOR_SLOPE * self.batch**0.6
        curve, floor, last = {}, 0.0, 1
        for n in sorted(self.sizes):
            if n in measured:
                value, last = measured[n], n
            else:
                above = [m for m in measured if m > n]
                if above:
                    hi = min(above)
                    value = measured[last] + (measured[hi] - measured[last]) * (n - last) / (hi - last)
                else:
                    value = measured[last] + slope * (n - last)
            floor = max(floor, value)
            curve[n] = floor
        return curve

    def fix(self, curve: dict[int, float], decode_seconds: float | None = None) -> None:
        """Set the calibration by hand (`curve`: relative costs per size, 1 -> 1.0; `decode_seconds`: a plain step's,
        None: unknown): nothing is measured any more, the runner's choices are its own. For tests and for users who
        measured their model themselves."""
        self.ways, self.paths = (None,), (None,)
        self.fixed = ({1: 1.0, **{int(n): float(c) for n, c in curve.items()}}, decode_seconds)
        self.sizes = set(self.fixed[0])

    def apply(self, runner: Runner) -> None:
        """Set the runner's choices as measured so far: its one-node path (the tree path until measured, where the
        runner chooses) and its linears per size (packed until measured)."""
        if self.paths != (None,) and chooses_path(runner):
            runner.choose(single_node_path=self._plain_path())
        if self.ways != (None,):
            runner.choose(packed_sizes=self.packed_sizes())

    # ------------------------------------------------------------------ measuring
    def pending(self) -> Iterator[tuple]:
        """The measurements still to run, the most useful first: a plain step on both paths (the one plain steps take
        decides most of a large batch's time: HF's decode path took 1.5x the tree path's at batch 16 on the embedded
        target), the largest size, the other sizes (largest first), the other ways; then the repeats, taking turns."""
        if self.fixed is not None:
            return
        items = self.items()
        first = [i for i in items if i[2] == self.ways[0]]
        nodes = [i for i in first if i[0] == "node"]
        first = nodes + sorted((i for i in first if i[0] == "size"), key=lambda i: -i[1])
        order = first + [i for i in items if i not in first]
        for want in range(REPEATS + 1):  # the warm-up round, then the timed rounds
            for item in order:
                if self.runs.get(item, 0) <= want:
                    yield item

    def measure(
        self, runner: Runner, budget: float | None = None, estimate: float = 0.0, cap: int | None = None
    ) -> float:
        """Run pending measurements on the runner (each rolled back) until `budget` seconds would be exceeded (None:
        until complete; under tensor parallelism, every process's timings agreed in one collective at the end, as the
        slowest process measured them). `estimate`: what a measurement of unknown cost is expected to take at least (a
        step's seconds). `cap`: the largest size the call's memory is known to hold (larger ones wait). A size whose
        measurement runs out of memory (torch.OutOfMemoryError) is rolled back and dropped with every larger one
        (`out_of_memory` keeps it). Returns the seconds spent; the runner's choices are set as measured (`apply`)."""
        spent, timed = 0.0, []
        for item in self.pending():
            if item[0] == "size" and (item[1] not in self.sizes or (cap is not None and item[1] > cap)):
                continue
            expected = self.best.get(item) or max([*self.best.values(), estimate])
            if budget is not None and spent + expected > budget:
                break
            t0 = time.perf_counter()
            try:
                seconds = _time(runner, item)
            except torch.OutOfMemoryError:
                if item[0] != "size":  # a one-node step that does not fit: nothing smaller to verify
                    raise
                spent += time.perf_counter() - t0
                self._drop_from(item[1])
                continue
            spent += time.perf_counter() - t0
            if self.runs.get(item, 0) > 0:  # (the first run warms up)
                timed.append((item, seconds))
                if budget is not None:
                    self.best[item] = min(self.best.get(item, float("inf")), seconds)
            self.runs[item] = self.runs.get(item, 0) + 1
        if budget is None:  # every process's times agreed in one collective (the slowest process's), then kept
            for item, seconds in zip(
                [i for i, _ in timed], runner.agreement.seconds([s for _, s in timed]), strict=True
            ):
                self.best[item] = min(self.best.get(item, float("inf")), seconds)
        self.spent += spent
        self.apply(runner)
        return spent

    def _drop_from(self, n: int) -> None:
        """Size `n` ran out of memory: it and every larger size are no longer measured (nor priced as measured)."""
        self.out_of_memory = n if self.out_of_memory is None else min(self.out_of_memory, n)
        self.sizes = {s for s in self.sizes if s < n}
        for table in (self.best, self.runs):
            for key in [k for k in table if k[0] == "size" and k[1] >= n]:
                del table[key]

    def measure_between_steps(self, runner: Runner, step_seconds: float, cap: int | None = None) -> float:
        """After a step of `step_seconds`: measure within what the steps so far earned (SHARE of their time, every
        call on this model and key together, so that short calls add up; the first call spends at most SHARE of its
        own). `cap`: as `measure`'s. Returns the seconds spent."""
        self.earned += SHARE * step_seconds
        budget = self.earned - self.between
        if budget <= 0 or self.complete:
            return 0.0
        spent = self.measure(runner, budget, estimate=step_seconds, cap=cap)
        self.between += spent
        return spent

    # ------------------------------------------------------------------ persistence
    def to_json(self) -> dict:
        items = [[list(i), self.runs.get(i, 0), self.best.get(i)] for i in self.items()]
        return {"ways": list(self.ways), "paths": list(self.paths), "batch": self.batch, "sizes": sorted(self.sizes),
                "spent": self.spent, "items": items}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict) -> Calibration:
        out = cls(tuple(data["ways"]), tuple(data["paths"]), int(data["batch"]))
        out.sizes = {int(n) for n in data["sizes"]}
        out.spent = float(data.get("spent", 0.0))
        for item, runs, best in data["items"]:
            key = (str(item[0]), item[1], item[2])
            out.runs[key] = int(runs)
            if best is not None:
                out.best[key] = float(best)
        return out


def _time(runner: Runner, item: tuple) -> float:
    """Seconds of one measurement (see `Calibration.items`), rolled back: a one-node step's forward and commit from a
    snapshot, an n-node chain's forward then discarded; with captured steps, every size's forward and commit (a commit
    is a step of its own there, captured and timed with its verify step); with steps compiled on a CPU, every size's
    greedy step as greedy calls run it (one replay and one read: `ModelRunner.decode`, `.verify_greedy`; a sampled
    step's separate verify and commit cost more, unmeasured)."""
    kind, key, way = item
    batch, device = runner.n_real.shape[0], runner.n_real.device
    if way is not None:
        runner.choose(packed_sizes={1 if kind == "node" else key: way})
    if kind == "node" and key is not None:
        runner.choose(single_node_path=key)
    n = 1 if kind == "node" else key
    tree = runner.prepare(TokenTree.chain(torch.zeros(batch, n, dtype=torch.long, device=device)))
    commits = n == 1 or runner.graphs
    snap = runner.snapshot() if commits else None  # (a commit is rolled back from a snapshot)
    t0 = time.perf_counter()
    try:
        # a greedy step of compiled steps is one replay and one read: a plain step's (ModelRunner.decode), once
        # captured, and a drafted tree's, verified, accepted and committed in one graph (ModelRunner.verify_greedy)
        fused = runner.fuse_single_nodes
        picks = runner.decode(tree.tokens[:, 0]) if n == 1 and fused else None
        if picks is not None:
            picks.tolist()
            return time.perf_counter() - t0
        if n > 1 and fused:
            runner.verify_greedy(tree)
            return time.perf_counter() - t0
        runner.verify(tree)
        if commits:
            runner.commit(torch.zeros(batch, dtype=torch.long, device=device))
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0
    finally:  # rolled back whether it finished or raised (out of memory)
        if snap is None:
            runner.discard()
        else:
            runner.restore(snap)


def chooses_packing(runner: Runner) -> bool:
    """Whether `runner`'s forwards may run its model's linears packed or not per tree size (ssmspec.linear.packs):
    an eager runner on a CPU model with packed linears big enough to pack (the runner's `chooses_packing`)."""
    return bool(runner.chooses_packing)


def chooses_path(runner: Runner) -> bool:
    """Whether the runner's one-node steps may take HF's decode path or the tree path, as measured (not set by the
    caller)."""
    return bool(runner.chooses_single_node_path)


def call_sizes(runner: Runner) -> list[int]:
    """The sizes a call can verify: powers of two up to its largest padded tree, and that one, each as the call pads it
    (a compiled model compiles a graph per size measured, so sizes no tree of this call reaches are left to a call
    that needs them)."""
    largest = min(runner.padded_size(runner.max_nodes) if runner.max_nodes else COST_SIZES[-1], LARGEST_MEASURED)
    return sorted({min(runner.padded_size(n), largest) for n in COST_SIZES if n < largest} | {largest})


def for_runner(model: nn.Module, runner: Runner) -> Calibration:
    """The model's calibration for this runner's batch size, device and path: kept on the model; a new one starts
    from what the disk holds for this model and machine (`CALIBRATION_DIR`)."""
    key = _key(runner)
    kept = model.__dict__.setdefault("_ssmspec_calibration", {})
    ways = (True, False) if chooses_packing(runner) else (None,)
    paths = (True, False) if chooses_path(runner) else (None,)
    calibration = kept.get(key)
    if calibration is None or (calibration.fixed is None and (calibration.ways, calibration.paths) != (ways, paths)):
        calibration = _load(model, runner, key)
        if calibration is None or (calibration.ways, calibration.paths) != (ways, paths):
            calibration = Calibration(ways, paths, int(runner.n_real.shape[0]))
        kept[key] = calibration
    calibration.want(call_sizes(runner))
    return calibration


def kept(
    model: nn.Module, batch: int = 1, device: str | torch.device = "cpu", path: str = "seams"
) -> Calibration | None:
    """The calibration kept on a transformed `model` for calls of `batch` rows on `device` (`path` "generic": HF's
    forward, whose calibrations are its own), or None where no call has started one: what the adaptive policy prices
    with (`Calibration.curve`, `.decode_seconds`, `.complete`). Public as `ssmspec.calibration_of`."""
    return model.__dict__.get("_ssmspec_calibration", {}).get(_key_of(batch, torch.device(device).type, path))


def fixed(model: nn.Module, batch: int, curve: dict[int, float], decode_seconds: float | None = None,
          device: str = "cpu", path: str = "seams") -> Calibration:  # fmt: skip
    """Give `model` a calibration set by hand for a batch size and device (`Calibration.fix`): its calls price with
    it and measure nothing."""
    calibration = Calibration(batch=batch)
    calibration.fix(curve, decode_seconds)
    model.__dict__.setdefault("_ssmspec_calibration", {})[_key_of(batch, device, path)] = calibration
    return calibration


def complete_before(model: nn.Module, runner: Runner, sampling: bool) -> bool:
    """Whether a call completes the calibration before its first step rather than between steps: a call that samples
    (a seeded call then draws the same tokens whatever ran before), a sharded model (every process must verify the
    same trees: its timings are agreed in one collective) and a call under `ssmspec.calibrate` (a compiled model's
    warm-up among them: every tree-size bucket is compiled then, not on a user's call)."""
    return sampling or runner.agreement.sharded or bool(model.__dict__.get("_ssmspec_calibrating"))


def _key(runner: Runner) -> tuple:
    """What a calibration is kept under on the model: batch size and device; HF's forward on the generic path has
    calibrations of its own."""
    return _key_of(int(runner.n_real.shape[0]), runner.n_real.device.type, runner.path)


def _key_of(batch: int, device: str, path: str = "seams") -> tuple:
    """(batch, device type), and the path where it is HF's forward ("generic")."""
    return (int(batch), device) if path != "generic" else (int(batch), device, path)


def measure_cost(runner: Runner, sizes: Sequence[int] = COST_SIZES) -> dict[int, float]:
    """The verify-cost curve of `sizes` on the runner's prefilled cache, measured completely now (a fresh
    Calibration: see the module docstring): relative to a one-node step, non-decreasing; `runner.packed_sizes` set
    where it may choose."""
    calibration = Calibration((True, False) if chooses_packing(runner) else (None,), batch=1)
    calibration.sizes = set(sizes) | {1}
    calibration.measure(runner)
    return {n: c for n, c in calibration.curve().items() if n in set(sizes) | {1}}


# ---------------------------------------------------------------------- on disk
def directory() -> Path | None:
    """Where calibrations are kept (`CALIBRATION_DIR`), or None where that is "off"."""
    where = os.environ.get(CALIBRATION_DIR)
    if where is not None and where.strip().lower() in ("", "0", "off", "none", "false"):
        return None
    if where:
        return Path(where).expanduser() / "calibration"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ssmspec" / "calibration"


def signature(model: nn.Module, runner: Runner) -> str | None:
    """What a calibration on disk is kept under: the model's architecture (its config without names and paths), its
    dtype, how ssmspec runs it (packed linears, compiled, kernel policy), the machine (processor or GPU, threads) and
    the versions of torch and ssmspec; None where none is kept: a sharded model (every process must agree) and a
    compiled one (static shapes: its warm-up verifies every tree-size bucket to compile it, and measures as it goes;
    one taken from disk would leave the buckets to compile on a user's first call)."""
    if runner.agreement.sharded or runner.static_shapes:
        return None
    config = model.config.to_dict()
    for name in ("_name_or_path", "name_or_path", "transformers_version", "_commit_hash"):
        config.pop(name, None)
    device = runner.device
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    about = {
        "model": type(model).__name__, "config": config, "dtype": str(runner.dtype), "device": device.type,
        "machine": machine, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "ssmspec": __version__, "packed": bool(runner.prepack),
        "compiled": repr(compiled_as(model).options),
        "kernels": repr(getattr(model, "ssmspec_kernel_policy", None)), "static": bool(runner.static_shapes),
    }  # fmt: skip
    return hashlib.sha256(json.dumps(about, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _cpu_name() -> str:
    """The processor's model name (Linux /proc/cpuinfo), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load(model: nn.Module, runner: Runner, key: tuple) -> Calibration | None:
    """The calibration the disk holds for this model, machine and key, else None (also for an unreadable file)."""
    where, sig = directory(), signature(model, runner)
    if where is None or sig is None:
        return None
    try:
        data = json.loads((where / f"{sig}.json").read_text())
        entry = data["entries"].get(json.dumps(list(key))) if data.get("format") == FORMAT else None
        return Calibration.from_json(entry) if entry is not None else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(model: nn.Module, runner: Runner, calibration: Calibration) -> None:
    """Keep `calibration` on disk for this model and machine (atomically; a directory that cannot be written to is
    left alone: the calibration is measured again in the next process)."""
    where, sig = directory(), signature(model, runner)
    if where is None or sig is None or calibration.fixed is not None:
        return
    path = where / f"{sig}.json"
    try:
        where.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
            entries = data["entries"] if data.get("format") == FORMAT else {}
        except (OSError, ValueError, KeyError):
            entries = {}
        entries[json.dumps(list(_key(runner)))] = calibration.to_json()
        with tempfile.NamedTemporaryFile("w", dir=where, suffix=".tmp", delete=False) as f:
            json.dump({"format": FORMAT, "about": type(model).__name__, "entries": entries}, f)
        os.replace(f.name, path)
    except OSError:
        return
