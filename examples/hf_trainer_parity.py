"""The Hugging Face Trainer and a plain accelerate loop keep one process's loss curve
under DDP and gradient accumulation.

A small BERT classifier (transformers' own, built from a config: hidden, attention and
classifier dropout 0.1; float64) fine-tunes on a synthetic dataset on the CPU, with
``transformers.Trainer`` and with a plain ``accelerate`` loop (``accelerator.accumulate``).
Every run sees the same global batch of 8 samples per optimizer step, dealt its own way:

* ``one process``: batches of 8;
* ``one process, accumulation 2``: 2 microbatches of 4 per optimizer step;
* ``DDP=2`` (``torchrun --nproc-per-node 2``, gloo): 4 samples per rank;
* ``DDP=2, accumulation 2``: 2 samples per rank and microbatch - each rank's rows of a
  step are two blocks, 4 rows apart, as accelerate's loader deals them.

The Trainer runs a second time with ``gradient_checkpointing=True`` ("Trainer (ckpt)"):
the backward recomputes each layer's forward, which must draw the same masks.

The user's one line: ``class Trainer(compile_rng.TrainerMixin, transformers.Trainer)``,
or ``for batch in compile_rng.accelerate_batches(accelerator, loader)``. With it every
configuration trains its loop's one-process curve (every step's loss in float64, to
~1e-16); without it each draws other dropout masks and the curves part.

Run: ``python examples/hf_trainer_parity.py`` (the table; about a minute on 2 cores).
"""

from __future__ import annotations

import json
import os
import tempfile

import torch

from _cli import launch, rank_or_table

SAMPLES, GLOBAL_BATCH, SEQ, VOCAB = 40, 8, 16, 64


def _dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(1, VOCAB, (SAMPLES, SEQ), generator=g)
    labels = (tokens[:, 0] > VOCAB // 2).long()
    return [{"input_ids": t, "labels": y} for t, y in zip(tokens, labels)]


def _model():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=SEQ, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
        classifier_dropout=0.1, num_labels=2,
    )
    model = BertForSequenceClassification(config).double()
    # Its loss is a mean over the batch already: without this the Trainer treats it as a
    # token sum (an LM's) and scales it by the accumulation steps and the world size.
    model.accepts_loss_kwargs = False
    return model


def _mean_over_ranks(loss: torch.Tensor) -> float:
    import torch.distributed as dist

    total = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(total)
        total /= dist.get_world_size()
    return total.item()


def make_trainer(batch: int, accumulation: int, parity: bool, folder: str, **arguments) -> tuple[object, list[float]]:
    """A ``transformers.Trainer`` (with ``compile_rng.TrainerMixin`` when ``parity``) on
    the model and dataset, and the list it appends every optimizer step's mean loss over
    the global batch to (float64; the Trainer's own log is float32). ``arguments``
    override the ``TrainingArguments``."""
    import transformers
    from transformers import TrainerCallback, TrainingArguments

    import compile_rng

    class Recorded(transformers.Trainer):
        step_loss = 0.0

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.step_loss = self.step_loss + loss.double()  # already divided by the accumulation
            return loss

    # the one line a user adds: compile_rng.TrainerMixin before the Trainer
    trainer_class = type("Trainer", (compile_rng.TrainerMixin, Recorded) if parity else (Recorded,), {})
    losses: list[float] = []

    class Losses(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            losses.append(_mean_over_ranks(trainer.step_loss))
            trainer.step_loss = 0.0

    transformers.set_seed(0)
    settings = dict(
        output_dir=os.path.join(folder, "trainer"), use_cpu=True, seed=0,
        per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation, num_train_epochs=1,
        learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None, ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
    )
    args = TrainingArguments(**{**settings, **arguments})
    trainer = trainer_class(model=_model(), args=args, train_dataset=_dataset(), callbacks=[Losses()])
    return trainer, losses


def train_trainer(batch: int, accumulation: int, parity: bool, folder: str) -> list[float]:
    """One epoch of ``transformers.Trainer``: every optimizer step's loss (:func:`make_trainer`)."""
    trainer, losses = make_trainer(batch, accumulation, parity, folder)
    trainer.train()
    return losses


def prepare_accelerate(batch: int, accumulation: int) -> tuple:
    """A fresh ``Accelerator`` and what it prepared: ``(accelerator, model, optimizer,
    loader)``, the loader shuffled by its own generator."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import DataLoader

    AcceleratorState._reset_state(True)  # the Trainer's, when both run in this process
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    loader = DataLoader(_dataset(), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(3))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    return accelerator, model, optimizer, loader


def accelerate_epoch(accelerator, model, optimizer, loader, parity: bool, steps: int | None = None) -> list[float]:
    """One epoch (or its first ``steps`` optimizer steps) of a plain ``accelerate`` loop
    (``accelerator.accumulate``): every optimizer step's mean loss over the global batch."""
    import compile_rng

    accumulation = accelerator.gradient_accumulation_steps
    losses, step_loss = [], 0.0
    # the one line a user changes: the loader, wrapped
    batches = compile_rng.accelerate_batches(accelerator, loader) if parity else loader
    for inputs in batches:
        with accelerator.accumulate(model):
            loss = model(**inputs).loss
            accelerator.backward(loss)
            step_loss = step_loss + loss.detach() / accumulation
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients:
                losses.append(_mean_over_ranks(step_loss))
                step_loss = 0.0
                if len(losses) == steps:
                    break
    return losses


def train_accelerate(batch: int, accumulation: int, parity: bool, folder: str) -> list[float]:
    """One epoch of a plain ``accelerate`` loop."""
    return accelerate_epoch(*prepare_accelerate(batch, accumulation), parity)


def train_trainer_checkpointed(batch: int, accumulation: int, parity: bool, folder: str) -> list[float]:
    """The Trainer with ``gradient_checkpointing=True`` (transformers' default: reentrant
    ``torch.utils.checkpoint`` around each layer): the backward's recomputed forward must
    draw the forward's masks."""
    trainer, losses = make_trainer(batch, accumulation, parity, folder, gradient_checkpointing=True)
    trainer.train()
    return losses


LOOPS = {"Trainer": train_trainer, "Trainer (ckpt)": train_trainer_checkpointed, "accelerate": train_accelerate}


CONFIGS = {  # name: (ranks, per-device batch, gradient accumulation)
    "one process": (1, 8, 1),
    "one process, accumulation 2": (1, 4, 2),
    "DDP=2": (2, 4, 1),
    "DDP=2, accumulation 2": (2, 2, 2),
}


def run(ranks: int, runs: list[tuple[str, str, bool]], folder: str) -> dict[tuple[str, str, bool], list[float]]:
    """Losses of ``(loop, configuration, parity)`` runs that all have ``ranks`` ranks, in
    one fresh process (``torchrun`` for 2 ranks)."""
    out = os.path.join(folder, f"losses-{ranks}.json")
    losses = launch(__file__, ranks, ["--train", json.dumps([list(r) for r in runs])], out)
    return {tuple(k): v for k, v in losses}


def _train(spec: str, out: str) -> None:
    import torch.distributed as dist

    results = []
    with tempfile.TemporaryDirectory() as folder:
        for loop, name, parity in json.loads(spec):
            _, batch, accumulation = CONFIGS[name]
            results.append(((loop, name, parity), LOOPS[loop](batch, accumulation, parity, folder)))
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def relative(curve: list[float], reference: list[float]) -> float:
    assert len(curve) == len(reference) == SAMPLES // GLOBAL_BATCH, (len(curve), len(reference))
    return max(abs(a - b) / abs(b) for a, b in zip(curve, reference))


def table(runs: list[tuple[str, str, bool]]) -> dict[tuple[str, str, bool], float]:
    """Max relative loss difference of each run from its loop's one-process run with the
    same ``parity`` (which the runs must include)."""
    with tempfile.TemporaryDirectory() as folder:
        losses = {}
        for ranks in sorted({CONFIGS[name][0] for _, name, _ in runs}):
            losses.update(run(ranks, [r for r in runs if CONFIGS[r[1]][0] == ranks], folder))
    return {r: relative(losses[r], losses[(r[0], "one process", r[2])]) for r in runs if r[1] != "one process"}


def _print_table() -> None:
    runs = [(loop, name, parity) for loop in LOOPS for name in CONFIGS for parity in (True, False)]
    cells = table(runs)
    print("max relative difference of every step's loss (float64) from the loop's one process")
    print(f"{'configuration':30} " + " ".join(f"{f'{loop} {kind}':>22}" for loop in LOOPS for kind in ("compile_rng", "stock")))
    for name in list(CONFIGS)[1:]:
        print(f"{name:30} " + " ".join(f"{cells[(loop, name, p)]:22.1e}" for loop in LOOPS for p in (True, False)))


def main() -> None:
    runs_help = "JSON list of [loop, configuration, parity] to run in this process"
    rank_or_table(__doc__, "--train", runs_help, _train, _print_table, out="losses.json")


if __name__ == "__main__":
    main()
