"""Loading a trained model back from a run folder or checkpoint, for `predict` and `generate`: the run's own
workload rebuilds it (its code imported only as workload.check_trusted allows), then come the checkpoint's
weights. `LanguageSample`: the sample a training run ends with."""

from __future__ import annotations

from pathlib import Path

import torch

from ddplab.callbacks import Callback
from ddplab.config import Config
from ddplab.config.frozen import freeze
from ddplab.config.reading import from_dict
from ddplab.engine.loop.setup import build_data, build_model
from ddplab.engine.run_folder.folder import RunFiles, RunFolder
from ddplab.engine.snapshots.read import load_checkpoint
from ddplab.errors import RunError, UserError, first_line
from ddplab.registry import workload
from ddplab.tasks import restore
from ddplab.workload import Assets, Data, build_config, check_trusted
from ddplab.workloads.char_lm import CharTokenizer


def read_checkpoint(path: str | Path) -> tuple[dict, Config, Path]:
    """(checkpoint dict, its Config, where it was found) from a run folder or checkpoint file."""
    found, ckpt = load_checkpoint(path)
    tree = ckpt["config"]  # without model.weights: the checkpoint holds every weight; that file may be gone
    cfg = freeze(from_dict({**tree, "model": {**tree.get("model", {}), "weights": None}}))
    return ckpt, cfg, found


def load_model(path: str | Path, trust_code: bool = False, checkpoint=None, saved: Assets | None = None):
    """(model in eval mode, checkpoint dict, Data). Given `saved` (what the run saved for inference), the
    Data is what the run's data function builds from it; else the checkpoint's task and meta only."""
    ckpt, cfg, _ = checkpoint or read_checkpoint(path)
    meta = ckpt.get("meta", {})
    run = RunFiles.around(path)  # code inside the run folder it was read from is the run's own
    for name in ("model.name", "data.name"):
        check_trusted(getattr(cfg, name.split(".")[0]).name, trust_code, name, run.path if run else path)
    work = workload(cfg)
    if saved is not None:
        data = _data(cfg, work, saved)
        data.meta = {**data.meta, **meta}  # what the weights were trained with wins
    else:
        data = Data(train=None, task=restore(ckpt.get("task")), meta=meta)
    if data.train is None:
        shape = data.input_shape or meta.get("input_shape")
        data.input_shape = tuple(shape) if shape else None
        model = _rebuilt(cfg.model.name, lambda: work.model(build_config(cfg, "model"), data))
    else:  # checked on two training samples, as training checks it
        model = _rebuilt(cfg.model.name, lambda: build_model(cfg, None, work, data))
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as exc:
        raise UserError(
            f"{path}: the checkpoint's weights do not fit the model its config builds ({first_line(exc, 160)})"
        ) from None
    model.eval()
    return model, ckpt, data


def _data(cfg, work, saved: Assets) -> Data:
    """The run's data function on what the run saved; one that reads files which are gone says so."""
    try:
        return build_data(cfg, None, work, saved)
    except RunError as exc:
        if saved.files or not isinstance(exc.__cause__, (FileNotFoundError, NotADirectoryError)):
            raise
        raise UserError(
            f"data.name={cfg.data.name} cannot read its data ({first_line(exc.__cause__, 120)}), and the run saved "
            f"nothing for inference (its Data lists no assets), so predict needs the data where training read it: "
            f"put it back, or name the files preprocessing needs in Data(assets=...) and train again "
            f"(docs/your-workload.md#inference-from-the-run-folder-alone)"
        ) from None


def _rebuilt(name: str, build) -> torch.nn.Module:
    try:
        model = build()
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported in one line
        raise UserError(
            f"model.name={name} cannot be rebuilt from the checkpoint ({type(exc).__name__}: {first_line(exc, 160)})"
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"model.name={name} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def sample(
    model, meta: dict, prompt: str, max_new_tokens: int, temperature: float = 0.8, top_k: int | None = 40, seed: int = 0
) -> str:
    if meta.get("tokenizer") not in ("char", "byte"):
        raise UserError("this checkpoint is not a character / byte language model")
    tokenizer = CharTokenizer.from_meta(meta)
    ids = tokenizer.encode(prompt or "\n")
    device = next(model.parameters()).device
    idx = torch.as_tensor(ids, dtype=torch.long, device=device)[None, :]
    g = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=g)
    model.train(was_training)
    return tokenizer.decode(out[0].tolist())


class LanguageSample(Callback):
    """At a complete run's end, a character / byte language model's sample (generate.*): in sample.txt and
    train.log. Sharded, every rank takes part in each forward pass; rank 0 writes."""

    def on_train_end(self, view, summary) -> None:
        cfg, meta, g = view.config, view.data.meta, view.config.generate
        if (
            summary["status"] == "complete"
            and (view.is_main or cfg.distributed.strategy != "ddp")
            and meta.get("tokenizer") in ("char", "byte")
            and g.max_new_tokens > 0
        ):
            text = sample(
                view.model, meta, g.prompt, g.max_new_tokens, g.temperature, g.top_k, seed=cfg.experiment.seed
            )
            view.run.write_text(RunFolder.SAMPLE, text)
            view.run.log("sample:\n" + text)
