"""One typed config tree. Field names are public; each field's `help` becomes `ddplab train --help` and the docs'
config reference; reading.validate checks `choices`, `min`, `max`, `positive` (and every number is finite)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import Field, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from ddplab.config.frozen import Section, plain
from ddplab.errors import UserError

# The largest integer any field takes: torch's int64. Fields with a tighter bound declare their own `max`.
INT_MAX = 2**63 - 1
# The longest duration a field takes (seconds): a year. Longer ones overflow timedelta or mean a typo.
MAX_SECONDS = 365 * 86400
# The most processes of any count (loader workers, replica groups): Linux's PID_MAX_LIMIT, the most processes one
# machine can run whatever its size. A count up to it is then checked against the cores and memory there are.
MAX_PROCESSES = 2**22


def _f(
    default: Any,
    help: str,
    *,
    choices: tuple | None = None,
    min: float | None = None,
    max: float | None = None,
    positive: bool = False,
) -> Any:
    meta = {"help": help, "choices": choices, "min": min, "max": max, "positive": positive}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ExperimentConfig(Section):
    name: str | None = _f(None, "run folder name under output_dir; default <model>-<data>")
    output_dir: str = _f("experiments", "folder that holds run folders")
    seed: int = _f(1337, "seed for weights, data order, dropout", min=0, max=2**31 - 1)  # + rank: NumPy's 32 bits
    repeats: int = _f(1, "runs of each point in `ddplab study` (same seed); --repeat overrides", positive=True)


@dataclass
class DataConfig(Section):
    name: str = _f(
        "text", "dataset: a built-in name (listed below) or your own file.py:function / package.module:function"
    )
    options: dict = _f({}, "free-form values for your own data function (data.options.KEY=VALUE)")
    path: str | None = _f(
        None, "text file or folder of .txt files (data.name=text); default: the embedded Shakespeare corpus"
    )
    root: str | None = _f(None, "dataset folder for torchvision datasets and image_folder")
    train: str | None = _f(
        None,
        "train file (CSV/JSON/Parquet) for text_files; with data.stream, the training shards of any streamed source",
    )
    val: str | None = _f(None, "validation file for text_files; with data.stream, the validation shards")
    test: str | None = _f(None, "test file for text_files; with data.stream, the test shards")
    stream: bool = _f(
        False,
        "read data.train / data.val / data.test as shards (a file, folder, glob or fsspec URL) through "
        "ddplab.Shards, a window at a time, instead of whole into memory or a cache: data.name text "
        "(text, JSON lines, Parquet, Arrow), text_files (JSON lines, Parquet, Arrow), image_folder "
        "(WebDataset tar)",
    )
    text_column: str = _f("text", "text column of text_files")
    label_column: str = _f("label", "label column of text_files")
    tokenizer: str | None = _f(
        None, "hash | hf | char | byte; default depends on the model", choices=("hash", "hf", "char", "byte", None)
    )
    vocab_size: int = _f(30000, "hash tokenizer buckets", positive=True)
    max_len: int = _f(256, "tokens per text sample (truncation)", positive=True)
    val_fraction: float = _f(0.1, "share of train carved out for validation when no split exists", min=0.0)
    test_fraction: float = _f(
        0.1, "share carved out as a test split when none exists (digits, image_folder without test/)", min=0.0
    )
    limit: int | None = _f(None, "cap on training samples (quick runs)", positive=True)
    num_samples: int = _f(2000, "size of generated datasets (synthetic, synthetic_reviews)", positive=True)
    num_classes: int | None = _f(None, "classes of generated datasets")
    image_size: int | None = _f(None, "resize images to this side; default per model")
    augment: bool = _f(False, "random crop + horizontal flip for training images")
    per_sample_seed: bool = _f(
        True,
        "read each training sample under a seed of (experiment.seed, epoch, sample "
        "index), so random augmentation is the same whatever the world size or workers "
        "(map-style datasets; torch's generator, and Python's random and numpy's where "
        "the transform draws from them)",
    )
    download: bool = _f(False, "let torchvision / HF datasets download when files are missing")
    cache_dir: str | None = _f(None, "cache folder for HF datasets (tokenised splits included) and image caches")
    cache: str = _f(
        "raw",
        "image_folder trees decoded once into a cache: raw (uint8 pixels, memory-mapped), jpeg "
        "(re-encoded at the training size, quality 90, decoded each epoch; a fifth of raw's disk) "
        "or false (each file decoded every epoch)",
        choices=("raw", "jpeg", "false"),
    )
    decode: str = _f(
        "cpu",
        "where JPEG images are decoded: cpu (in the loader workers) or gpu (nvJPEG on the rank's "
        "GPU, in batches, after the loader; image_folder with data.cache=jpeg or false)",
        choices=("cpu", "gpu"),
    )
    num_workers: int | None = _f(
        None,
        "DataLoader worker processes per rank; default: 0 on CPU; on CUDA the cores this "
        "rank may use (CPU affinity / processes on the node) less one; more than 4 per core, or more than "
        "the memory available holds, are cut down (a line says so)",
        min=0,
        max=MAX_PROCESSES,
    )
    pin_memory: bool = _f(True, "pinned host memory for CUDA copies (ignored on CPU)")


@dataclass
class ModelConfig(Section):
    name: str = _f(
        "gpt", "model: a built-in name (listed below) or your own file.py:function / package.module:function"
    )
    options: dict = _f({}, "free-form values for your own model function (model.options.KEY=VALUE)")
    layers: int = _f(3, "transformer layers", positive=True)
    heads: int = _f(4, "attention heads", positive=True)
    dim: int = _f(128, "embedding width", positive=True)
    ff_dim: int | None = _f(None, "feed-forward width; default 4 x dim", positive=True)
    context: int = _f(64, "tokens of context (GPT block size)", positive=True)
    dropout: float = _f(0.0, "dropout probability", min=0.0)
    dropout_off: bool = _f(
        False,
        "set p=0 in every torch.nn.Dropout module of the model, yours too (ddplab verify "
        "sets it: each process draws its own dropout masks)",
    )
    bias: bool = _f(False, "bias in linear layers and layer norms (GPT)")
    pooling: str = _f("cls", "sequence pooling of classifiers", choices=("cls", "mean"))
    patch_size: int = _f(4, "ViT patch side", positive=True)
    pretrained: str | None = _f(None, "HF hub name or local folder (model.name=hf, vit)")
    weights: str | None = _f(None, "local weights file for torchvision models")
    freeze: bool = _f(False, "freeze the pretrained encoder / feature extractor")


@dataclass
class EarlyStoppingConfig(Section):
    monitor: str | None = _f(
        None,
        "end the run when this column of the epoch rows (val_loss, val_accuracy, ...) "
        "stops improving; null: no early stopping",
    )
    mode: str = _f("min", "min: lower is better; max: higher is better", choices=("min", "max"))
    patience: int = _f(3, "whole epochs without improvement before the run stops", positive=True)
    min_delta: float = _f(0.0, "an improvement is a change by more than this", min=0.0)


@dataclass
class TrainingConfig(Section):
    epochs: int | None = _f(
        None,
        "passes over the training set; not set: 2, or with a stream and training.max_steps, as many as max_steps takes",
        positive=True,
    )
    max_steps: int | None = _f(None, "stop after this many optimizer steps", positive=True)
    time_budget: str | None = _f(None, "stop after this much training time: 2h, 90m, 30s (at most 365d)")
    batch_size: int = _f(32, "samples per process per micro-step", positive=True)
    grad_accum_steps: int = _f(1, "micro-steps per optimizer step", positive=True)
    lr: float = _f(3e-3, "peak learning rate (before lr_scaling)", positive=True)
    min_lr_ratio: float = _f(0.1, "final learning rate as a share of the peak (cosine, linear)", min=0.0, max=1.0)
    optimizer: str = _f(
        "adamw",
        "adamw, sgd, any torch.optim class (RMSprop, Adagrad, ...) or your own "
        "file.py:function / package.module:function of (cfg, model) -> optimizer",
    )
    optimizer_options: dict = _f(
        {}, "keyword arguments of the optimizer (training.optimizer_options.KEY=VALUE; your function's cfg.options)"
    )
    momentum: float = _f(0.9, "SGD momentum", min=0.0, max=1.0)
    weight_decay: float = _f(0.01, "decoupled weight decay", min=0.0)
    warmup_steps: int = _f(50, "linear warm-up steps", min=0)
    schedule: str = _f(
        "cosine",
        "learning-rate schedule after warm-up: cosine, linear, constant, or your own "
        "file.py:function / package.module:function of (cfg, optimizer, total_steps) -> "
        "LR scheduler (no warm-up added)",
    )
    schedule_options: dict = _f({}, "free-form values for your own schedule function (its cfg.options)")
    lr_scaling: str = _f("none", "scale lr with world size", choices=("none", "linear", "sqrt"))
    clip_grad_norm: float | None = _f(1.0, "clip gradients to this global norm; null disables", positive=True)
    amp: str = _f("none", "autocast precision", choices=("none", "fp16", "bf16"))
    tf32: bool = _f(
        True,
        "TF32 tensor cores for float32 matmuls and convolutions on CUDA (Ampere and later); on by "
        "default, as training tolerates TF32's 10-bit mantissa and gains its speed; torch's own "
        "default is off for matmuls (exact float32 for general linear algebra); false: off for both",
    )
    compile: bool = _f(
        False,
        "torch.compile the model (the batch dimension dynamic: one compile, whatever the last "
        "batch's size; evaluation runs the model uncompiled)",
    )
    channels_last: str = _f(
        "auto",
        "channels_last memory format for 4-D convolution weights and image batches; auto: "
        "on for convolutional models on CUDA",
        choices=("auto", "true", "false"),
    )
    eval_every: int | None = _f(None, "also evaluate every N optimizer steps", positive=True)
    nonfinite: str = _f("stop", "on a non-finite loss on any rank: stop or skip the step", choices=("stop", "skip"))
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    keep_host_memory: bool = _f(
        True,
        "glibc keeps freed host memory for the next step instead of returning it to "
        "the OS (no page faults per step on CPU; Linux)",
    )


@dataclass
class CheckpointConfig(Section):
    every: int | None = _f(None, "snapshot every N optimizer steps (always at epoch end)", positive=True)
    keep_last: int = _f(2, "complete snapshots kept", positive=True)
    resume: str = _f("auto", "auto (newest complete snapshot), never, or a snapshot path")
    save_best: bool = _f(True, "keep the model with the best validation loss")
    async_save: bool = _f(
        False,
        "fsdp/hsdp: write snapshots in the background (DCP async_save) while training "
        "goes on (`async` is a Python keyword)",
    )
    checksums: bool = _f(
        True,
        "record each snapshot file's CRC-32C in its manifest and check it before the "
        "snapshot is trusted (false: sizes only)",
    )
    allow_changed_data: bool = _f(
        False,
        "resume over data that changed since the snapshot (its files, sizes or first items), "
        "said in the log and recorded; false: such a resume is refused",
    )


@dataclass
class DistributedConfig(Section):
    backend: str = _f("auto", "process-group backend", choices=("auto", "nccl", "gloo"))
    timeout: float = _f(600.0, "seconds before a stuck collective fails the job", positive=True, max=MAX_SECONDS)
    stall_warning: float = _f(
        60.0, "seconds without progress before rank 0 names the stalled rank", positive=True, max=MAX_SECONDS
    )
    bucket_cap_mb: float = _f(25.0, "DDP gradient bucket size", positive=True)
    comm_hook: str = _f("none", "DDP communication hook", choices=("none", "fp16", "bf16", "powersgd"))
    simulated_latency_ms: float = _f(0.0, "delay added to every gradient all-reduce", min=0.0, max=MAX_SECONDS * 1000)
    simulated_bandwidth_mbps: float | None = _f(None, "cap on simulated link bandwidth", positive=True)
    find_unused_parameters: bool = _f(False, "DDP find_unused_parameters (frozen or unused layers)")
    sync_batchnorm: bool = _f(
        False, "BatchNorm statistics over the global batch (torch.nn.SyncBatchNorm), not each process's own; CUDA only"
    )
    strategy: str = _f(
        "ddp",
        "ddp (replicas), fsdp (FSDP2: parameters, gradients and optimizer state sharded over "
        "all processes) or hsdp (sharded within a node, replicated across nodes)",
        choices=("ddp", "fsdp", "hsdp"),
    )
    shard: str | None = _f(
        None,
        "your own shard(model, mesh) function (file.py:shard) that calls fully_shard on "
        "the model's blocks; default: the model's blocks, see the sharding page",
    )
    fault_tolerance: str = _f(
        "none",
        "replicas: the job runs as replica groups (torchft: ddplab's ft extra) "
        "that keep training when one dies and copy a rejoining group's state from a "
        "live one; see the fault-tolerance page",
        choices=("none", "replicas"),
    )
    lighthouse: str | None = _f(
        None,
        "fault_tolerance=replicas: the torchft Lighthouse's address (http://host:"
        "port); default $TORCHFT_LIGHTHOUSE (`--replica-groups N` starts one)",
    )
    # Unset (None) until registry.load_config resolves them from the launcher's environment: every reader sees ints.
    replica_group: int | None = _f(
        None,
        "fault_tolerance=replicas: this group's number, 0 to replica_groups - 1; default $REPLICA_GROUP_ID "
        "(set by torchft's torchx launcher), else the task's place in a SLURM job array ($SLURM_ARRAY_TASK_ID - "
        "$SLURM_ARRAY_TASK_MIN), else 0",
        min=0,
        max=MAX_PROCESSES - 1,
    )
    replica_groups: int | None = _f(
        None,
        "fault_tolerance=replicas: how many groups the job has; the training data is split in as many shares; "
        "default $NUM_REPLICA_GROUPS, else the SLURM job array's $SLURM_ARRAY_TASK_COUNT, else 1",
        positive=True,
        max=MAX_PROCESSES,
    )
    replica_lr: str = _f(
        "fixed",
        "fault_tolerance=replicas, while groups are missing: fixed (the lr stays; the "
        "gradient is the mean over the groups present) or follow (the lr is scaled by the "
        "share of groups present, as the global batch is)",
        choices=("fixed", "follow"),
    )
    shard_min_params: int = _f(
        1_000_000,
        "fsdp/hsdp on a model that names no blocks: every child module with at "
        "least this many parameters is sharded on its own",
        positive=True,
    )


@dataclass
class LoggingConfig(Section):
    trackers: list = _f(
        ["tensorboard"],
        "where metrics also go: [] or any of tensorboard (tensorboard/ in the run "
        "folder), mlflow, wandb (ddplab's track extra); see the tracking page",
        choices=("tensorboard", "mlflow", "wandb"),
    )
    mlflow_uri: str | None = _f(
        None,
        "MLflow tracking URI; default $MLFLOW_TRACKING_URI, else the "
        "local store <experiment.output_dir>/mlflow/mlflow.db",
    )
    mlflow_experiment: str = _f("ddplab", "MLflow experiment that holds the runs")
    wandb_project: str = _f("ddplab", "W&B project (WANDB_MODE=offline: files in the run folder's wandb/)")
    progress: bool = _f(True, "progress bar on rank 0 (terminals only)")
    log_every: int = _f(10, "optimizer steps between train-loss logs", positive=True)
    straggler_threshold: float = _f(
        0.2, "a rank slower than the median by this share, log after log, is named a straggler", positive=True
    )
    plots: bool = _f(
        True,
        "draw confusion_matrix_<split>.png at the end of a classification run (about a second "
        "and a half, matplotlib's import included; the .csv is always written)",
    )


@dataclass
class GenerateConfig(Section):
    prompt: str = _f("\n", "prompt for the sample printed after training a language model")
    max_new_tokens: int = _f(300, "tokens to sample (0 disables the sample)", min=0)
    temperature: float = _f(0.8, "sampling temperature; 0 = greedy (the most likely token)", min=0.0)
    top_k: int | None = _f(40, "sample among the k most likely tokens; 0 or null = all", min=0)


@dataclass
class Config(Section):
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)

    def to_dict(self) -> dict:
        return plain(self)

    def run_name(self) -> str:
        """The run folder's name; each replica group of a fault-tolerant job has its own, <name>-group<i>."""
        name = self.experiment.name or f"{_short(self.model.name)}-{_short(self.data.name)}"
        d = self.distributed
        return f"{name}-group{d.replica_group}" if d.fault_tolerance == "replicas" else name


def _short(name: str) -> str:
    """A folder-safe name: `path/to/my_file.py:model` -> `my_file.model`."""
    where, colon, function = name.rpartition(":")
    return f"{Path(where).stem if where.endswith('.py') else where}.{function}" if colon else name


def leaves(section: Any, prefix: str = "") -> Iterator[tuple[str, Field, Any]]:
    """(dotted name, field, value) of every field of the tree that is not a section."""
    for f in fields(section):
        value = getattr(section, f.name)
        if is_dataclass(value):
            yield from leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, value


def describe_fields() -> list[tuple[str, str, str]]:
    """(dotted name, default, help) for every field, for --help texts and docs."""
    return [(dotted, repr(value), f.metadata.get("help", "")) for dotted, f, value in leaves(Config())]


def batch_arithmetic(batch_size: int, grad_accum_steps: int, world_size: int, train_samples: int | None = None) -> dict:
    """The one place where batches are counted: global = per process x accumulation x world size. With
    `train_samples`, also the optimizer steps of one epoch (the sampler pads every rank to ceil(N / world size),
    the loader keeps the last short batch); without, None: a stream's epoch ends when the stream does."""
    out = {
        "per_process": batch_size,
        "grad_accum_steps": grad_accum_steps,
        "world_size": world_size,
        "global": batch_size * grad_accum_steps * world_size,
        "steps_per_epoch": None,
    }
    if train_samples is not None:
        per_rank = math.ceil(train_samples / world_size)
        out["steps_per_epoch"] = math.ceil(math.ceil(per_rank / batch_size) / grad_accum_steps)
    return out


def link_delay_s(nbytes: float, world_size: int, latency_ms: float, bandwidth_mbps: float | None) -> float:
    """The seconds distributed.simulated_latency_ms and simulated_bandwidth_mbps add to one all-reduce of
    `nbytes` per rank (for the comm hook that sleeps it and the forecast): a delay per message plus serialising
    what a ring all-reduce sends per rank, 2 (N - 1) / N times the payload."""
    delay = latency_ms / 1000.0
    if bandwidth_mbps:
        sent = 2 * (world_size - 1) / world_size * nbytes
        delay += sent * 8 / (bandwidth_mbps * 1e6)
    return delay


def keep_global_batch(global_batch: int, batch_size: int, world_size: int) -> int:
    """The training.grad_accum_steps that keeps a run's global batch on `world_size` processes."""
    accum, rest = divmod(global_batch, batch_size * world_size)
    if rest or not accum:
        fits = [b for b in range(min(batch_size, global_batch), 0, -1) if global_batch % (b * world_size) == 0]
        fix = (
            f"set training.batch_size={fits[0]}" if fits else f"resume with a process count that divides {global_batch}"
        )
        raise UserError(
            f"cannot keep the run's global batch of {global_batch} on {world_size} processes with "
            f"training.batch_size={batch_size} (no accumulation makes {batch_size} x {world_size} x "
            f"steps = {global_batch}): {fix}"
        )
    return accum
