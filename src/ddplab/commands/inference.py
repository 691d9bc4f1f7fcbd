"""`ddplab generate`, `ddplab predict` and `ddplab export`: a trained model on new inputs, or out of ddplab."""

from __future__ import annotations

import json
from pathlib import Path

from ddplab.commands import at_least, output_file
from ddplab.commands.predict import expand, line, output_format, write
from ddplab.commands.predict import predict as predict_rows
from ddplab.commands.trained_model import load_model, sample
from ddplab.engine.run_folder.files import write_atomic
from ddplab.engine.snapshots.read import load_checkpoint
from ddplab.errors import ExitCode, RunError, UserError


def generate(ns) -> int:
    at_least("--max-new-tokens", ns.max_new_tokens)
    at_least("--temperature", ns.temperature, 0, " (0 = greedy)")
    at_least("--top-k", ns.top_k, 0, " (0 = no top-k)")
    model, ckpt, _ = load_model(ns.run, ns.trust_code)
    print(sample(model, ckpt.get("meta", {}), ns.prompt, ns.max_new_tokens, ns.temperature, ns.top_k, ns.seed))
    return ExitCode.OK


def predict(ns) -> int:
    items = list(ns.inputs)
    if ns.file:
        if not Path(ns.file).is_file():
            raise UserError(f"--file: no such file: {ns.file}")
        items += [text.rstrip("\n") for text in open(ns.file, encoding="utf-8") if text.strip()]
    if not items:
        raise UserError("predict: give inputs on the command line or --file")
    at_least("--batch-size", ns.batch_size)
    at_least("--top-k", ns.top_k)
    if ns.output:  # a wrong name, or a file it must not replace, is refused before the model is built
        output_format(ns.output)
        output_file(ns.output, ns.force)
    rows = predict_rows(ns.run, expand(items), ns.batch_size, ns.top_k, ns.trust_code)
    for row in rows:
        print(line(row))
    if ns.output:
        write(rows, ns.output)
    return ExitCode.OK


def export(ns) -> int:
    """The best (else the last) model as one safetensors file, every parameter whole (a sharded snapshot's
    shards gathered), for `model.load_state_dict(safetensors.torch.load_file(FILE))` without ddplab."""
    from safetensors.torch import save  # imported by this command only

    run = Path(ns.run)
    # The default file is the run's own export, replaced by the next; --output names any other place.
    out = run / "model.safetensors" if run.is_dir() else run.with_suffix(".safetensors")
    if ns.output:
        out = output_file(ns.output, ns.force)
    found, ckpt = load_checkpoint(ns.run)
    # Tied weights (a GPT's embedding and head) share storage, which safetensors refuses: each is stored whole.
    weights = {k: v.detach().contiguous().clone() for k, v in ckpt["model"].items()}
    blob = save(weights, metadata={"config": json.dumps(ckpt.get("config", {})), "source": str(found)})
    try:
        write_atomic(out.parent, out.name, blob)
    except OSError as exc:
        raise UserError(f"--output: cannot write {out} ({exc.strerror})") from None
    except RunError as exc:  # a link where the file belongs
        raise UserError(str(exc)) from None
    print(f"{out}: {len(weights)} tensors, {sum(v.numel() for v in weights.values()):,} values, from {found}")
    return ExitCode.OK
