"""A resumed run is the same run: the Trainer, accelerate and a plain DDP loop resume bitwise.

transformers' BERT classifier (float64, dropout 0.1; ``examples/hf_trainer_parity.py``)
trains for 10 optimizer steps of a global batch of 8 (two epochs of 40 samples) in three
loops, each the way its users write it:

* ``Trainer``: ``class Trainer(compile_rng.TrainerMixin, transformers.Trainer)``; a
  checkpoint every 4 steps (``save_steps``), resumed with the Trainer's own
  ``train(resume_from_checkpoint=...)``;
* ``accelerate``: ``compile_rng.accelerate_batches`` around the loader,
  ``accelerator.save_state``; the resume registers ``compile_rng.StreamState()`` before
  ``accelerator.load_state`` and skips the trained batches (``skip_first_batches``);
* ``plain``: a hand-written data-parallel loop in ``compile_rng.step``, one
  ``torch.save`` of the model, optimizer and ``compile_rng.state_dict()``.

Each run stops after step 4 with its checkpoint saved; a fresh process (a fresh process
group under ``torchrun``) resumes it for steps 5-10, whose losses are compared with the
uninterrupted run's. Configurations: one process; ``DDP=2`` (``torchrun --nproc-per-node
2``, 4 samples per rank), and ``DDP=2 resumed as one process`` (an elastic restart: batches
of 8), compared with the uninterrupted DDP=2 run. Modes: ``compile_rng``; ``state left
out`` (the same resume with the stream put back where the fresh process had it after the
load: the control, which must differ); ``stock`` (the loop without compile_rng's
integration: torch's own RNG state, which the Trainer and accelerate save and restore).

Run: ``python examples/resume_parity.py`` (the table; about two minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings

import torch

import hf_trainer_parity as hf
from _cli import launch, rank_or_table

STEPS, STOP, BATCH = 10, 4, hf.GLOBAL_BATCH
EPOCHS = STEPS * BATCH // hf.SAMPLES
MODES = ("compile_rng", "state left out", "stock")
LOOPS = ("Trainer", "accelerate", "plain")
CONFIGS = {  # name: (ranks that save, ranks that resume)
    "one process": (1, 1),
    "DDP=2": (2, 2),
    "DDP=2 resumed as one process": (2, 1),
}
ELASTIC = ("Trainer", "plain")  # the loops resumed on another number of ranks


def _world() -> tuple[int, int]:
    """``(rank, world size)`` as ``torchrun`` set them (the Trainer makes the process group)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


# --- the Trainer ------------------------------------------------------------------------


def trainer(phase: str, mode: str, folder: str, checkpoint: str | None) -> list[float]:
    """``phase``: "whole" (10 steps), "first" (stop after step 4, checkpoint-4 saved in
    ``folder``) or "resume" (from ``checkpoint``, steps 5-10)."""
    from transformers import TrainerCallback

    class StopAfter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = phase == "first" and state.global_step == STOP

    _, world = _world()
    t, losses = hf.make_trainer(
        BATCH // world, 1, mode != "stock", folder, output_dir=folder, num_train_epochs=EPOCHS,
        save_strategy="steps", save_steps=STOP,
    )
    t.add_callback(StopAfter())
    if phase == "resume" and mode == "state left out":
        # the checkpoint as a release without compile_rng's state saved it
        left_out = f"{folder}-left-out-{_world()[0]}"
        shutil.copytree(checkpoint, left_out, ignore=shutil.ignore_patterns("compile_rng_state_*"))
        checkpoint, t.compile_rng_resume_without_state = left_out, True
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "compile_rng.TrainerMixin: the checkpoint")
        t.train(resume_from_checkpoint=checkpoint if phase == "resume" else None)
    return losses


def trainer_refuses(checkpoint: str, folder: str) -> str:
    """The message the mixin raises when resuming ``checkpoint`` (saved by the stock
    Trainer, without compile_rng's state), or "" if it does not raise."""
    from compile_rng.stream.checkpointing import MissingStreamState

    t, _ = hf.make_trainer(BATCH, 1, True, folder, output_dir=folder, num_train_epochs=EPOCHS)
    try:
        t.train(resume_from_checkpoint=checkpoint)
    except MissingStreamState as e:
        return str(e)
    return ""


# --- accelerate -------------------------------------------------------------------------


def accelerate(phase: str, mode: str, folder: str, checkpoint: str | None) -> list[float]:
    import compile_rng

    _, world = _world()
    accelerator, model, optimizer, loader = hf.prepare_accelerate(BATCH // world, 1)
    parity = mode != "stock"
    if phase == "first":
        losses = hf.accelerate_epoch(accelerator, model, optimizer, loader, parity, steps=STOP)
        accelerator.save_state(os.path.join(folder, f"checkpoint-{STOP}"))
        return losses
    first = loader
    if phase == "resume":
        if parity:  # the line a resuming user adds: register the stream before loading
            accelerator.register_for_checkpointing(compile_rng.StreamState())
        before = compile_rng.state_dict()
        accelerator.load_state(checkpoint)
        if mode == "state left out":
            compile_rng.load_state_dict(before)
        first = accelerator.skip_first_batches(loader, STOP)
    losses = hf.accelerate_epoch(accelerator, model, optimizer, first, parity)
    for _ in range(EPOCHS - 1):
        losses += hf.accelerate_epoch(accelerator, model, optimizer, loader, parity)
    return losses


# --- a plain data-parallel loop ---------------------------------------------------------


def plain(phase: str, mode: str, folder: str, checkpoint: str | None) -> list[float]:
    """Rank ``r`` of ``W`` holds rows ``[r * 8 / W, (r + 1) * 8 / W)`` of each step's
    global batch (the dataset in order, cycled); gradients averaged by hand."""
    import torch.distributed as dist

    import compile_rng

    rank, world = _world()
    parity = mode != "stock"
    torch.manual_seed(0)
    model = hf._model()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    data = hf._dataset()
    first, last = (STOP, STEPS) if phase == "resume" else (0, STOP if phase == "first" else STEPS)
    if phase == "resume":
        saved = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["torch"])
        if mode == "compile_rng":
            compile_rng.load_state_dict(saved["compile_rng"])
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    group = dist.group.WORLD if world > 1 else None
    local = BATCH // world
    losses = []
    for s in range(first, last):
        rows = [data[(s * BATCH + rank * local + i) % len(data)] for i in range(local)]
        inputs = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        if parity:
            with compile_rng.step(local, data_parallel=group):
                loss = model(**inputs).loss
        else:
            loss = model(**inputs).loss
        loss.backward()
        for p in model.parameters():
            if world > 1:
                dist.all_reduce(p.grad)
                p.grad /= world
        optimizer.step()
        optimizer.zero_grad()
        losses.append(hf._mean_over_ranks(loss))
    if phase == "first" and rank == 0:
        torch.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "torch": torch.get_rng_state(),
             "compile_rng": compile_rng.state_dict()},
            checkpoint,
        )
    if world > 1:
        dist.barrier()
    return losses


TRAIN = {"Trainer": trainer, "accelerate": accelerate, "plain": plain}


def _checkpoint(loop: str, folder: str) -> str:
    return os.path.join(folder, "checkpoint.pt") if loop == "plain" else os.path.join(folder, f"checkpoint-{STOP}")


def _folder(root: str, loop: str, saved_by: int, mode: str) -> str:
    """Where the run of ``loop`` on ``saved_by`` ranks in ``mode`` keeps its checkpoints
    (the control resumes compile_rng's checkpoint)."""
    return os.path.join(root, f"{loop}-{saved_by}-{'stock' if mode == 'stock' else 'compile_rng'}")


def _phase(spec: str, root: str, out: str) -> None:
    """Run the ``[phase, loop, mode]`` runs of ``spec`` in this process."""
    rank, world = _world()
    results = []
    for phase, loop, mode, saved_by, ranks in json.loads(spec):
        folder = _folder(root, loop, saved_by, mode)
        if phase == "refuse":
            results.append([[phase, loop, mode, saved_by, ranks], trainer_refuses(_checkpoint(loop, folder), root + "/r")])
            continue
        os.makedirs(folder, exist_ok=True)
        run_folder = folder if phase != "whole" else folder + "-whole"
        if phase == "resume":  # resumed in its own folder: the saved checkpoint stays as it was
            run_folder = f"{folder}-resumed-{world}-{mode}"
        losses = TRAIN[loop](phase, mode, run_folder, _checkpoint(loop, folder))
        results.append([[phase, loop, mode, saved_by, ranks], losses])
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def _launch(ranks: int, runs: list, root: str) -> list:
    out = os.path.join(root, f"results-{len(os.listdir(root))}.json")
    return launch(__file__, ranks, ["--phase", json.dumps(runs), "--root", root], out)


def relative(curve: list[float], reference: list[float]) -> float:
    assert len(curve) == len(reference) == STEPS - STOP, (len(curve), len(reference))
    return max(abs(a - b) / abs(b) for a, b in zip(curve, reference))


def table(loops: tuple[str, ...] = LOOPS) -> tuple[dict, dict]:
    """``({(loop, configuration, mode): max relative difference of steps 5-10 from the
    uninterrupted run}, {loop: the message resuming a stock checkpoint raised})``. Every
    launch is a fresh process (group)."""
    runs: dict = {}
    with tempfile.TemporaryDirectory() as root:
        for ranks in (1, 2):  # the uninterrupted runs, and the ones that stop after step 4
            saving = [[p, loop, m, ranks, ranks] for loop in loops for m in ("compile_rng", "stock") for p in ("whole", "first")]
            runs.update({tuple(k): v for k, v in _launch(ranks, saving, root)})
        for ranks in (1, 2):
            resumes = [
                ["resume", loop, mode, saved_by, ranks] for name, (saved_by, resumed_on) in CONFIGS.items()
                if resumed_on == ranks for loop in loops if saved_by == resumed_on or loop in ELASTIC for mode in MODES
            ]
            if ranks == 1 and "Trainer" in loops:
                resumes.append(["refuse", "Trainer", "stock", 1, 1])
            runs.update({tuple(k): v for k, v in _launch(ranks, resumes, root)})
    cells = {}
    for name, (saved_by, resumed_on) in CONFIGS.items():
        for loop in loops:
            if saved_by != resumed_on and loop not in ELASTIC:
                continue
            for mode in MODES:
                kind = "stock" if mode == "stock" else "compile_rng"
                whole = runs[("whole", loop, kind, saved_by, saved_by)]
                assert runs[("first", loop, kind, saved_by, saved_by)] == whole[:STOP]
                cells[(loop, name, mode)] = relative(runs[("resume", loop, mode, saved_by, resumed_on)], whole[STOP:])
    refused = {k[1]: v for k, v in runs.items() if k[0] == "refuse"}
    return cells, refused


def _print_table() -> None:
    cells, refused = table()
    print(f"steps {STOP + 1}-{STEPS} after a resume: max relative loss difference from the uninterrupted run (float64)")
    print(f"{'loop':11} {'configuration':30} " + " ".join(f"{m:>15}" for m in MODES))
    for loop in LOOPS:
        for name in CONFIGS:
            if (loop, name, MODES[0]) in cells:
                print(f"{loop:11} {name:30} " + " ".join(f"{cells[(loop, name, m)]:15.1e}" for m in MODES))
    for loop, message in refused.items():
        print(f"{loop} resuming a checkpoint saved without compile_rng's state: {'refused' if message else 'NOT refused'}")


def main() -> None:
    runs_help = "JSON list of [phase, loop, mode, saving ranks, ranks] to run here"
    rank_or_table(__doc__, "--phase", runs_help, _phase, _print_table, root=None, out=None)


if __name__ == "__main__":
    main()
