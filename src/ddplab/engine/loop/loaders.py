"""DataLoaders for training and evaluation, and `TrainFeed` / `StreamFeed`: where training stands in its data."""

from __future__ import annotations

import math
import os
import signal
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import islice

import torch
from torch.utils.data import DataLoader, default_collate

from ddplab.data.sample_seed import PerSampleSeed
from ddplab.data.sampler import ResumableDistributedSampler
from ddplab.data.stream import Batch, Stream, Tagged, declared, is_stateful, is_stream
from ddplab.engine.parallel.torch_internals import loader_shutting_down, stop_loader_workers
from ddplab.runtime import process_state


def data_workers(requested: int | None, device: torch.device, processes_per_node: int) -> int:
    """data.num_workers, or none on CPU (the ranks use every core) and on CUDA every core this rank may use but one:
    decoding images is what keeps a GPU waiting (a fixed 4 left a 16-core host's GPU idle half of each epoch)."""
    if requested is not None:
        return requested
    if device.type != "cuda":
        return 0
    return max(0, _cores() // processes_per_node - 1)


# Loader workers past this many per core contend for the cores instead of hiding a read's or a decode's wait.
WORKERS_PER_CORE = 4


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _meminfo(key: str) -> int | None:
    """A /proc/meminfo or /proc/self/smaps_rollup-style field in bytes (None where Linux's files are not)."""
    path = "/proc/meminfo" if key.startswith("Mem") else "/proc/self/smaps_rollup"
    try:
        with open(path) as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def bounded_workers(workers: int, processes_per_node: int) -> tuple[int, str | None]:
    """`workers` per rank, cut to what this node holds (and the line that says so): WORKERS_PER_CORE for each core
    this rank may use, and what the available memory holds at its rank's private memory a worker (a forked worker
    copies every page it or Python's reference counts touch)."""
    share = max(1, _cores() // processes_per_node)
    allowed, why = WORKERS_PER_CORE * share, f"{WORKERS_PER_CORE} per core of the {share} this rank may use"
    available = _meminfo("MemAvailable") if workers else None  # none to cut: reading smaps_rollup takes 20 ms or more
    own = (_meminfo("Private_Dirty") or 0) + (_meminfo("Private_Clean") or 0) if available else 0
    if available and own and available // (own * processes_per_node) < allowed:
        allowed = int(available // (own * processes_per_node))
        why = (
            f"what {available / 2**30:.1f} GiB of available memory holds for {processes_per_node} rank(s) at "
            f"{own / 2**20:.0f} MiB a worker (its rank's private memory)"
        )
    if workers <= allowed:
        return workers, None
    return allowed, f"data.num_workers={workers} cut to {allowed} loader workers per rank: {why}"


def _worker_init(worker_id: int) -> None:
    """A loader worker dies with its rank: one stuck in a lock or a read would outlive it (the DataLoader's watchdog
    checks only idle ones), holding the job's output pipes, so that whoever waits for its output waits for ever.

    And the job's stop signals are its rank's to act on: one sent to the whole process group (`timeout`, `scancel`,
    the terminal's Ctrl-C) killed the workers at once (SIGTERM's and SIGUSR1's default; SIGINT ends torch's worker
    loop), and the rank's next batch failed the run before the rank could snapshot. The rank stops its workers
    as usual once it has; one its loader is shutting down still ends on the loader's SIGTERM (torch's for a worker
    stuck past 5 s). A handler, not SIG_IGN, which programs the worker runs would inherit."""
    process_state.die_with_parent()
    shutting_down = loader_shutting_down()

    def stop(signum, frame) -> None:
        if shutting_down is not None:
            threading.Thread(target=lambda: shutting_down() and os._exit(0), daemon=True).start()

    for sig in process_state.STOP_SIGNALS:
        signal.signal(sig, stop)


class Loaders:
    def __init__(self, d, ctx, collate_fn, batch_size: int, seed: int) -> None:
        """`d`: the data section; `batch_size`: training.batch_size; `seed`: experiment.seed."""
        self.d, self.ctx, self.collate_fn, self.batch_size, self.seed = d, ctx, collate_fn, batch_size, seed
        requested = data_workers(d.num_workers, ctx.device, ctx.launch.local_world_size)
        self.workers, self.cut = bounded_workers(requested, ctx.launch.local_world_size)  # cut: the line, or None
        self._eval: dict[int, DataLoader] = {}
        self._made: weakref.WeakSet[DataLoader] = weakref.WeakSet()

    def _make(
        self, dataset, sampler=None, workers: int | None = None, persistent: bool = True, collate=None, **extra
    ) -> DataLoader:
        workers = self.workers if workers is None else workers
        loader = DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            collate_fn=collate or self.collate_fn,
            num_workers=workers,
            persistent_workers=persistent and workers > 0,
            pin_memory=self.d.pin_memory and self.ctx.device.type == "cuda",
            worker_init_fn=_worker_init if workers > 0 else None,
            **extra,
        )
        self._made.add(loader)
        return loader

    def close(self) -> None:
        """Stop the persistent workers of every loader made here, now, all loaders together. Torch stops them only when
        nothing holds their loader (they outlived `ddplab.train()`), and at exit torch 2.11 joins each for 5 s on CUDA
        (30 workers held a finished run for over 2 minutes); one loader's need not wait for another's."""
        if loaders := list(self._made):
            with ThreadPoolExecutor(len(loaders)) as pool:
                list(pool.map(stop_loader_workers, loaders))

    def train(self, dataset, sampler=None) -> DataLoader:
        # Its own generator: creating an iterator must not consume the global RNG, or a run
        # resumed mid-epoch would draw different dropout masks than an unbroken one.
        generator = torch.Generator().manual_seed(self.seed)
        if sampler is not None:
            return self._make(dataset, sampler, generator=generator)
        # A stream's workers start afresh each epoch: persistent ones would keep the first epoch's position. Its
        # batches come tagged with their worker and size (StreamFeed counts each worker's share trained).
        tagged = Tagged(self.collate_fn or default_collate)
        workers = self.stream_workers(dataset.dataset)
        return self._make(dataset, workers=workers, persistent=False, collate=tagged, generator=generator)

    def stream_workers(self, dataset) -> int:
        """A stream that keeps its own position is read in the training process, where its state_dict() is the
        position training reached (in a worker it would run ahead)."""
        return 0 if is_stateful(dataset) else self.workers

    def evaluation(self, dataset) -> DataLoader:
        """One loader per split, kept: its workers persist instead of starting at every evaluation."""
        if id(dataset) not in self._eval:
            ctx = self.ctx
            if is_stream(dataset):
                stream = Stream(dataset, ctx.rank, ctx.world_size, self.batch_size)
                self._eval[id(dataset)] = self._make(stream, workers=self.stream_workers(dataset))
            else:  # rank r takes r, r+W, r+2W, ... with no padding: each sample counted once in the all-reduced sums
                self._eval[id(dataset)] = self._make(dataset, range(ctx.rank, len(dataset), ctx.world_size))
        return self._eval[id(dataset)]


class TrainFeed:
    """The training data's position: an epoch and the samples of its global order consumed (TrainState.consumed).
    Map-style data: ResumableDistributedSampler resumes by slicing its permutation; a stream: StreamFeed below."""

    sampler: ResumableDistributedSampler  # made by start()

    def __init__(self, dataset, loaders: Loaders, d, ctx, log: Callable[[str], None], share: tuple[int, int]) -> None:
        """`d`: the data section; `share`: (this process's share, shares) of each epoch's order (replica groups:
        engine/loop/parts.py)."""
        self.dataset, self.loaders, self.ctx, self.log = dataset, loaders, ctx, log
        if loaders.cut:
            log(loaders.cut)
        self.seed = loaders.seed
        self.size = declared(dataset, d.limit)  # None: a stream that does not know its length
        self.loader: DataLoader | None = None  # made at the first epoch, after the callbacks' on_train_start
        self.inexact: dict | None = None  # a resume that is not exact: how many samples may be read twice or skipped
        self.start(d, *share)

    @property
    def how(self) -> str | None:
        """How the training stream is split, for the start line (None: map-style data)."""
        return None

    def start(self, d, rank: int, world: int) -> None:
        self.sampler = ResumableDistributedSampler(self.dataset, world, rank, shuffle=True, seed=self.seed)
        if d.per_sample_seed:  # random augmentation as a function of (seed, epoch, sample)
            self.dataset = PerSampleSeed(self.dataset, self.seed)
            self.sampler.keyed = True

    def epoch(self, epoch: int, consumed: int) -> Iterator:
        """The batches of `epoch` after its first `consumed` samples (all ranks together)."""
        if self.loader is None:
            self.loader = self.loaders.train(self.dataset, self.sampler)
        # Worker seeds come from the loader's own generator: a function of the epoch only,
        # so a resumed epoch hands its workers the same seeds.
        self.loader.generator.manual_seed(self.seed + epoch)
        self.sampler.set_epoch(epoch, start=consumed)
        return iter(self.loader)

    def left(self) -> float:
        """Samples this rank has still to train on in the epoch (a stream: unknown, until it ends)."""
        return len(self.sampler)

    def next_step(self, batches: Iterator, accum: int) -> list:
        """The micro-batches of the next optimizer step; none when the epoch is over (the sampler gives every
        rank the same count)."""
        return list(islice(batches, accum))

    def end_epoch(self, n: int, steps: int, planned: int | None, notes: list, replan: Callable[[int], float]) -> dict:
        """Epoch `n` is whole, in `steps` steps: its row's columns (none: the sampler's length is exact)."""
        return {}

    def state_dict(self) -> dict:
        return {}  # TrainState's position is all

    def load_state_dict(self, state: dict | None) -> None:
        pass


class StreamFeed(TrainFeed):
    """A stream, through data.stream.Stream, resumed at `consumed` by seeking (ddplab.Shards), else from its own
    state_dict(), else by reading past what was consumed (one that shards itself: each loader worker past its own
    share). Its snapshot part: the stream's state and each rank's and loader worker's count trained in the epoch."""

    def start(self, d, rank: int, world: int) -> None:
        dataset, loaders = self.dataset, self.loaders
        self.source = Stream(dataset, rank, world, loaders.batch_size, d.limit, marked=True)
        self.workers = loaders.stream_workers(dataset)  # its loader workers
        if is_stateful(dataset) and loaders.workers:
            self.log(
                f"the training stream keeps its own position (state_dict()): it is read in the training process, "
                f"not by {loaders.workers} loader workers"
            )
        self._restored: dict = {}  # a snapshot's stream state, used when the epoch it was taken in resumes
        self.taken = [0] * max(self.workers, 1)  # this rank's items trained this epoch, per loader worker
        self.untrained = 0  # this rank's items the epoch ended without (uneven ranks)
        self.turn, self.done = 0, [False]  # a stream that shards itself: the worker whose batch is next; ended ones
        self.before = self.skipped = 0  # samples of the epoch read before this attempt (all ranks; this one)

    @property
    def how(self) -> str | None:
        if self.source.seeks:
            return "the training stream seeks its own share of one global order"
        if self.source.own:
            return "the training stream shards itself (its first items differ between ranks): ddplab splits nothing"
        return "the training stream is one global order: ddplab splits it among ranks and loader workers"

    def epoch(self, epoch: int, consumed: int) -> Iterator:
        if self.loader is None:  # no sampler: the Stream splits the order itself
            self.loader = self.loaders.train(self.source)
        self.loader.generator.manual_seed(self.seed + epoch)
        self.taken, self.untrained = [0] * max(self.workers, 1), 0
        self.turn, self.done = 0, [False] * max(self.workers, 1)
        self._stream_start(epoch, consumed)
        self.before, self.skipped = consumed, sum(self.taken)  # read before this attempt: all ranks', this rank's
        if self.workers > 1 and self.source.own:
            return self._in_turn(iter(self.loader))
        return iter(self.loader)

    def _in_turn(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        """A self-sharding stream's batches in the loader's own turn (worker by worker) from where the epoch stood: a
        DataLoader begins every epoch at worker 0, so a resumed epoch would take them in another order. A worker
        with none while another has 3 waiting has ended (its share was empty)."""
        workers, more = self.workers, True
        pending: list[deque[Batch]] = [deque() for _ in range(workers)]
        while live := [w for w in range(workers) if pending[w] or not self.done[w]]:
            w = min(live, key=lambda v: (v - self.turn) % workers)
            while not pending[w] and more and max(map(len, pending)) < 3:
                got = next(batches, None)
                more = got is not None
                if got is not None:
                    pending[got.worker].append(got)
            if not pending[w]:
                self.done[w] = True
                continue
            batch = pending[w].popleft()
            self.done[w] = batch.last
            self.turn = (w + 1) % workers
            yield batch

    def _stream_start(self, epoch: int, consumed: int) -> None:
        source = self.source
        restored, self._restored = self._restored, {}
        if not consumed:
            source.set_epoch(epoch)
            return
        if source.seeks:
            self.log(
                f"the training stream seeks to sample {consumed} of epoch {epoch + 1} itself (its order depends "
                f"on the seed and epoch alone: nothing is read twice, at any world size)"
            )
            source.set_epoch(epoch, consumed)
            return
        rank, world = self.ctx.rank, self.ctx.world_size
        same = restored.get("epoch") == epoch and restored.get("world_size") == world
        states = restored.get("states")
        if states and restored.get("epoch") == epoch and (not source.own or same):
            # The last rank has read exactly the first `consumed` items; a self-sharding stream, its own.
            self.dataset.load_state_dict(states[rank] if source.own else states[-1])
            self.log(
                f"the training stream resumes from its own state_dict(), {consumed} samples into epoch {epoch + 1}"
            )
            source.set_epoch(epoch, consumed, skip=False)
            return
        was_own = restored.get("own", source.own)  # the snapshot's stream sharded itself (or did not)
        if not source.own and not was_own:
            self.log(
                f"the training stream has no state_dict(): skipping forward past the first {consumed} samples of "
                f"epoch {epoch + 1} (read and dropped)"
            )
            source.set_epoch(epoch, consumed)
            return
        # A stream that shards itself: each rank's share alone is known to it, each loader worker's to that worker.
        taken = restored.get("taken")
        if source.own and same and taken is not None and len(taken[rank]) == len(self.taken):
            self.taken = list(taken[rank])
            self.turn, self.done = restored["turns"][rank], list(restored["done"][rank])
            self.log(
                f"the training stream shards itself: each rank's loader workers skip forward past their own "
                f"samples already trained ({sum(map(sum, taken))} in all, read and dropped); exact"
            )
            source.set_epoch(epoch, per_worker=self.taken)
            return
        # Another world size or worker count splits it otherwise: which samples were trained is not known here.
        workers, was = max(self.workers, 1) if source.own else 1, restored.get("world_size", world)
        self.taken = [consumed // world // workers] * len(self.taken)
        self.inexact = {"epoch": epoch + 1, "may_repeat": consumed, "may_skip": consumed}
        self.log(
            f"the training stream shards itself and was snapshotted at {was} processes x "
            f"{len(taken[0]) if taken else '?'} loader workers, now {world} x {max(self.workers, 1)}: each rank "
            f"skips forward past {consumed // world} samples; not exact: up to {consumed} samples of epoch "
            f"{epoch + 1} may be read twice, and as many skipped (metrics.json: data_notes)"
        )
        source.set_epoch(epoch, per_worker=self.taken)

    def left(self) -> float:
        return math.inf

    def next_step(self, batches: Iterator, accum: int) -> list:
        """Ranks agree (one all-reduce of a count) to take as many micro-batches as the rank with the fewest has,
        so that shards of uneven length end the epoch together instead of leaving a rank in a collective alone;
        what the others still hold is read to its end and counted (`untrained`), never trained unsaid."""
        micro = list(islice(batches, accum))
        agreed = int(self.ctx.all_reduce(torch.tensor([float(len(micro))], device=self.ctx.device), "min").item())
        for b in micro[:agreed]:
            self.taken[b.worker] += b.items
        if agreed < accum:  # the epoch's last step, on every rank
            self.untrained += sum(b.items for b in micro[agreed:]) + sum(b.items for b in batches)
        return [b.batch for b in micro[:agreed]]

    def end_epoch(self, n: int, steps: int, planned: int | None, notes: list, replan: Callable[[int], float]) -> dict:
        """Epoch `n` is whole, in `steps` steps: its row's columns (samples read, of them untrained). Steps other than
        `planned` (a wrong __len__, uneven ranks, none) plan the schedule and ETA again over the measured steps
        (`replan`), said in one line and recorded in `notes` (metrics.json: data_notes)."""
        read, untrained = self.read()
        columns = {"read_samples": read, "untrained_samples": untrained}
        if steps == planned:
            if untrained:  # the planned length, but uneven ranks left some of it
                self.log(f"epoch {n}: {untrained} of the stream's {read} samples untrained (uneven ranks)")
                notes.append({"epoch": n, "read_samples": read, "untrained_samples": untrained})
            return columns
        said = (
            f"WARNING: epoch {n}: Data.train's __len__ says {self.size} samples, the stream gave {read}"
            if self.size is not None and read != self.size
            else f"epoch {n}: the stream gave {read} samples"
        )
        untold = f", {untrained} of them untrained (uneven ranks)" if untrained else ""
        total = replan(steps)
        self.log(
            f"{said}{untold}: {steps} steps"
            + (f", not the {planned} planned" if planned is not None else "")
            + f"; the schedule and ETA are planned again over {steps} steps an epoch ({total} steps in all) "
            f"from epoch {n + 1}"
        )
        notes.append(
            {
                "epoch": n,
                "declared_samples": self.size,
                "read_samples": read,
                "untrained_samples": untrained,
                "planned_steps": planned,
                "measured_steps": steps,
            }
        )
        return columns

    def read(self) -> tuple[int, int]:
        """A collective for a stream: (samples of the epoch read by every rank, of them left untrained)."""
        this = sum(self.taken) - self.skipped + self.untrained
        counts = torch.tensor([float(this), float(self.untrained)], device=self.ctx.device)
        read, untrained = self.ctx.all_reduce(counts).tolist()
        return self.before + int(read), int(untrained)

    def state_dict(self) -> dict:
        """A collective: every rank's stream state and counts are gathered."""
        states = self.ctx.gather_objects(self.dataset.state_dict()) if is_stateful(self.dataset) else None
        taken, turns, done = zip(*self.ctx.gather_objects((list(self.taken), self.turn, list(self.done))), strict=True)
        return {
            "world_size": self.ctx.world_size,
            "own": self.source.own,  # the stream shards itself
            "epoch": self.source.epoch,
            "states": states,
            "taken": list(taken),  # each rank's items trained this epoch, per loader worker
            "turns": list(turns),  # each rank's loader worker whose batch comes next
            "done": list(done),  # each rank's loader workers whose share has ended
        }

    def load_state_dict(self, state: dict | None) -> None:
        self._restored = dict(state or {})


def train_feed(dataset, loaders: Loaders, d, ctx, log: Callable[[str], None], share: tuple[int, int]) -> TrainFeed:
    """The feed of the training split: a StreamFeed for a stream, else the plain (map-style) TrainFeed."""
    return (StreamFeed if is_stream(dataset) else TrainFeed)(dataset, loaders, d, ctx, log, share)
