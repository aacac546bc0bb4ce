"""The offline stages' loop, over the training floor (``training``) the learner stands on too:
start-up (process group, seed, logging, metrics), the model in its DeepSpeed engine, the batches of
each optimizer step dealt to the ranks in micro-batches, one optimizer step, and the output
written as an HF model directory.

Every rank draws the same shuffle, so every rank knows the whole batch and each example's weight
in its loss (tokens taught, pairs): a micro-batch's loss is its examples' summed loss over the
whole batch's weight, times the ranks (DeepSpeed averages the ranks' gradients), and the step's
gradient is the batch mean whatever the ranks and micro-batches. Forward-only passes (held-out
figures, calibration, DPO's reference) run over all examples on every rank: the same count of
passes everywhere, as ZeRO-3's gathers need.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from common.config import ConfigError, StageConfig, TetherConfig
from common.runlog import MetricsWriter, metrics_writer, setup_logging
from stages.examples import Example
from training import micro_batches, parallel
from training.optimizer_step import guarded_step

MARKER = "tether_stage.json"  # in a finished stage's output: the stage, its recipe and held-out figures


@dataclass
class Stage:
    """A stage's run as its loop needs it."""
    name: str
    cfg: StageConfig
    output: str
    seed: int
    recipe: dict
    log: object
    metrics: MetricsWriter | None  # rank 0's
    resume_step: int = 0  # the optimizer step of the saved state it goes on from (0: from the start)

    @property
    def state_dir(self) -> str:
        """Where the stage's whole state is saved (``checkpoint_every``, a stop signal)."""
        return self.output + ".state"


def start(config: TetherConfig, name: str, fresh: bool = False) -> Stage:
    """Logging, the process group (one rank without a launcher), the seed and, on rank 0, the
    stage's metrics (RUN_DIR/metrics/<name>.jsonl and TensorBoard). A state saved by an earlier
    run of the same recipe is gone on from (``restore``) unless ``fresh``; the metrics then keep
    that run's records up to it, else they start over."""
    cfg = config.stage(name)
    rank = int(os.environ.get("RANK", 0))
    log = setup_logging(name if rank == 0 else f"{name}{rank}", config.log_level)
    parallel.init_process_group(cfg.dist_port)
    if cfg.batch_size % parallel.world_size():
        raise ConfigError(f"{name}.batch_size ({cfg.batch_size}) must be a multiple of the {parallel.world_size()} "
                          "ranks")
    seed = config.seed if cfg.seed is None else cfg.seed
    torch.manual_seed(seed)
    stage = Stage(name, cfg, config.stage_output(name), seed, recipe_of(config, name), log, None)
    saved = _saved_state(stage.state_dir)
    if saved is not None and saved["recipe"] == stage.recipe and not fresh:
        stage.resume_step = saved["step"]
    if parallel.is_main():
        if stage.resume_step:
            _keep_records_to(config.run_dir, name, stage.resume_step)
        else:
            forget_stage_metrics(config.run_dir, name)
        stage.metrics = metrics_writer(config, name)
    return stage


def _saved_state(directory: str) -> dict | None:
    path = os.path.join(directory, "state.json")
    if not os.path.exists(path):
        return None
    with open(path) as file:
        return json.load(file)


def _keep_records_to(run_dir: str, name: str, step: int) -> None:
    path = os.path.join(run_dir, "metrics", f"{name}.jsonl")
    if os.path.exists(path):
        with open(path) as file:
            kept = [line for line in file if line.strip() and json.loads(line).get("step", 0) <= step]
        with open(path, "w") as file:
            file.writelines(kept)


def restore(engine, stage: Stage) -> int:
    """Load the saved state (weights, optimizer) into ``engine`` if the stage goes on from one;
    returns the step it is at (0: none). Every rank calls it."""
    if stage.resume_step:
        engine.load_checkpoint(stage.state_dir, tag="state")
        stage.log.info("%s: going on from the state saved at step %d (%s)", stage.name, stage.resume_step,
                       stage.state_dir)
    return stage.resume_step


def after_step(engine, stage: Stage, step: int, stop) -> None:
    """Save the stage's state every ``checkpoint_every`` steps, and when a stop signal came (then
    stop: ``training.signals.Preempted``, for the exit code 128 + the signal). Every rank calls it."""
    from training.checkpoints import fsync_tree, replace_directory
    from training.signals import Preempted, signal_name

    stopping = stop.requested()
    every = stage.cfg.checkpoint_every
    if not stopping and not (every and step % every == 0):
        return
    temporary = stage.state_dir + ".tmp"
    if parallel.is_main():
        shutil.rmtree(temporary, ignore_errors=True)
    parallel.barrier()
    engine.save_checkpoint(temporary, tag="state")
    parallel.barrier()
    if parallel.is_main():
        with open(os.path.join(temporary, "state.json"), "w") as file:
            json.dump({"recipe": stage.recipe, "step": step}, file)
        fsync_tree(temporary)
        replace_directory(temporary, stage.state_dir)
    parallel.barrier()
    if stopping:
        message = (f"{stage.name}: got {signal_name(stop.number)} at step {step}: saved {stage.state_dir}; the same "
                   f"command goes on from there")
        stage.log.warning("%s", message)
        raise Preempted(message, stop.number)


def finished(output: str, recipe: dict) -> dict | None:
    """The marker of a stage already written to ``output`` with this ``recipe``, else None."""
    path = os.path.join(output, MARKER)
    if not os.path.exists(path):
        return None
    with open(path) as file:
        marker = json.load(file)
    return marker if marker.get("recipe") == recipe else None


def recipe_of(config: TetherConfig, name: str) -> dict:
    """What makes a stage's output what it is: its section (and the seed it draws with)."""
    cfg = config.stage(name)
    return {"stage": name, "section": cfg.model_dump(mode="json"), "seed": config.seed if cfg.seed is None else cfg.seed}


def engine_of(model, stage: Stage):
    """``model`` (LoRA-wrapped with ``lora_rank``) in its DeepSpeed engine, as the learner's are."""
    from training.deepspeed_engine import deepspeed_engine

    cfg = stage.cfg
    return deepspeed_engine(model, cfg.lr, cfg, cfg.dtype, cfg.batch_size)


def batches(count: int, stage: Stage, epoch: int) -> list[torch.Tensor]:
    """Epoch ``epoch``'s batches of example indices, shuffled by (seed, epoch): ``batch_size`` each;
    the last one shorter, cut to a multiple of the ranks (dropped if less than one each)."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(stage.seed * 1_000_003 + epoch))
    world = parallel.world_size()
    out = []
    for indices in order.split(stage.cfg.batch_size):
        usable = len(indices) - len(indices) % world
        if usable:
            out.append(indices[:usable])
    return out


def steps_per_epoch(count: int, stage: Stage) -> int:
    return len(batches(count, stage, 0))


def rank_parts(indices: torch.Tensor, examples: list[Example], stage: Stage) -> list[list[int]]:
    """This rank's share of a batch (examples dealt by cost, so the ranks' shares are alike), in
    micro-batches of ``micro_batch_size`` examples and ``max_tokens_per_microbatch`` padded tokens
    at most, as many as every other rank has. An example's rows are never split."""
    costs = _costs([examples[int(i)] for i in indices])  # the batch's alone: positions in ``indices``
    mine = micro_batches.deal(torch.arange(len(indices)), costs, parallel.rank(), parallel.world_size())
    parts = micro_batches.micro_batches_of(mine, costs, stage.cfg, parallel.world_size())
    return [indices[part].tolist() for part in parts]


def forward_parts(examples: list[Example], stage: Stage) -> Iterator[list[Example]]:
    """``examples`` in the micro-batches a forward-only pass over all of them takes, on every rank
    the same (held-out figures, calibration, DPO's reference)."""
    for part in micro_batches.micro_batches_of(torch.arange(len(examples)), _costs(examples), stage.cfg, 1):
        yield [examples[int(i)] for i in part]


def _costs(examples: list[Example]) -> torch.Tensor:
    return torch.tensor([example.cost for example in examples], dtype=torch.long)


LossSums = Callable[[object, list[Example]], tuple[torch.Tensor, dict[str, float]]]


def train_step(engine, parts: list[list[int]], examples: list[Example], loss_sums: LossSums, weight: float,
               skipped, step: int) -> dict[str, float]:
    """One optimizer step over this rank's ``parts``: ``loss_sums(module, examples) -> (summed loss,
    summed statistics)`` for each micro-batch, scaled by the ranks over the batch's ``weight``
    (its tokens or pairs over all ranks), DeepSpeed accumulating to the boundary at the last. A
    step with NaN or inf gradients on any rank is skipped and counted in ``skipped`` (a
    ``training.optimizer_step.SkippedSteps``: too many in a row stop the stage). Returns the sums of the
    statistics over all ranks, and the gradient norm (NaN for a skipped step)."""
    world = parallel.world_size()
    sums: dict[str, float] = {}
    for index, part in enumerate(parts):
        engine.set_gradient_accumulation_boundary(index == len(parts) - 1)
        loss, stats = loss_sums(engine, [examples[i] for i in part])
        if not torch.isfinite(loss):
            raise FloatingPointError(f"the loss is {float(loss.detach())} at step {step}")
        engine.backward(loss * world / weight)
        for key, value in {"loss": float(loss.detach()), **stats}.items():
            sums[key] = sums.get(key, 0.0) + value
    grad_norm = guarded_step([engine], skipped, f"step {step}")
    totals = {key: value * world for key, value in parallel.mean_over_ranks(sums).items()}
    return {**totals, "grad_norm": math.nan if grad_norm is None else grad_norm}


@torch.no_grad()
def forward_sums(module, examples: list[Example], sums_of: LossSums, stage: Stage) -> dict[str, float]:
    """The summed loss and statistics of ``sums_of`` over ``examples``, forward only, in
    micro-batches like training's (every rank the same passes)."""
    was_training = module.training
    module.eval()
    sums: dict[str, float] = {}
    for part in forward_parts(examples, stage):
        loss, stats = sums_of(module, part)
        for key, value in {"loss": float(loss), **stats}.items():
            sums[key] = sums.get(key, 0.0) + value
    module.train(was_training)
    return sums


def evaluate_due(step: int, count: int, stage: Stage) -> bool:
    """Whether held-out figures are due after optimizer step ``step`` (1-based) of training on
    ``count`` examples, before the last: every ``eval_every`` steps, or at each epoch's end when
    it is 0 (after the last step they are taken anyway, for the output)."""
    if step >= total_steps(count, stage):
        return False
    every = stage.cfg.eval_every
    return step % every == 0 if every else step % steps_per_epoch(count, stage) == 0


def total_steps(count: int, stage: Stage) -> int:
    """Optimizer steps of training on ``count`` examples for ``epochs``."""
    return steps_per_epoch(count, stage) * stage.cfg.epochs


def optimizer_steps(engine, stage: Stage, count: int) -> Iterator[tuple[int, int, torch.Tensor, float]]:
    """(step, epoch, batch, learning rate) of each optimizer step left of training on ``count``
    examples, the rate set on ``engine`` (``lr_schedule``); the steps before a saved state the
    stage goes on from (``restore``, done here) are passed over."""
    from training.schedule import lr_factor, set_lr

    cfg, total, done = stage.cfg, total_steps(count, stage), restore(engine, stage)
    for step, (epoch, indices) in enumerate(epochs_of(count, stage), 1):
        if step <= done:
            continue
        lr = cfg.lr * lr_factor(step - 1, total, cfg.lr_warmup_steps, cfg.lr_schedule, cfg.lr_min_ratio)
        set_lr(engine, lr)
        yield step, epoch, indices, lr


class Progress:
    """A log line every few seconds and a metrics record each step (rank 0)."""

    def __init__(self, stage: Stage, total_steps: int, interval_s: float = 10.0) -> None:
        self.stage, self.total_steps, self.interval_s = stage, total_steps, interval_s
        self.started = self.logged = time.monotonic()
        self.examples = 0

    def step(self, step: int, epoch: int, record: dict[str, float], examples: int) -> None:
        self.examples += examples
        if self.stage.metrics is None:
            return
        elapsed = time.monotonic() - self.started
        record = {"step": step, "epoch": epoch, **record, "examples_per_s": self.examples / max(elapsed, 1e-9),
                  "elapsed_s": elapsed}
        self.stage.metrics.write(record)
        now = time.monotonic()
        if now - self.logged >= self.interval_s or step in (1, self.total_steps):
            self.logged = now
            figures = " ".join(f"{key} {record[key]:.4g}" for key in record
                               if key not in ("step", "epoch", "elapsed_s", "examples_per_s", "lr")
                               and isinstance(record[key], float))
            remaining = elapsed / step * (self.total_steps - step)
            self.stage.log.info("%s step %d/%d epoch %d %s (%.1f examples/s, %.0fs left)", self.stage.name, step,
                                self.total_steps, epoch + 1, figures, record["examples_per_s"], remaining)

    def held_out(self, step: int, figures: dict[str, float]) -> None:
        if self.stage.metrics is None or not figures:
            return
        self.stage.metrics.write({"step": step, **{f"eval_{key}": value for key, value in figures.items()}})
        self.stage.log.info("%s step %d held-out %s", self.stage.name, step,
                            " ".join(f"{key} {value:.4g}" for key, value in figures.items()))


def save_output(engine, source: str, stage: Stage, figures: dict[str, float],
                config_updates: dict | None = None) -> str:
    """The trained model as an HF directory at the stage's output (LoRA merged, as the rollout and
    scorer load it), the tokenizer of ``source`` beside it, ``config_updates`` in its config.json,
    and the marker that says the stage finished with this recipe. Every rank calls it."""
    from training.checkpoints import save_hf_checkpoint
    from training.lora import is_lora

    module = engine.module
    model_config = (module.get_base_model() if is_lora(module) else module).config
    for key, value in (config_updates or {}).items():
        setattr(model_config, key, value)
    save_hf_checkpoint(engine, source, stage.output)
    if parallel.is_main():
        with open(os.path.join(stage.output, MARKER), "w") as file:
            json.dump({"recipe": stage.recipe, "held_out": figures}, file, indent=2)
        shutil.rmtree(stage.state_dir, ignore_errors=True)  # finished: nothing to go on from
    parallel.barrier()
    return stage.output


def processor_of(stage: Stage):
    """The processor of the stage's model where it sees images (None: a text model)."""
    from common.processors import load_processor

    return load_processor(stage.cfg.model)


def examples_loaded(stage: Stage, tokenizer, processor=None) -> tuple[list[Example], list[Example]]:
    """(train, held out) examples of the stage's data (``processor``: a model that sees reads their
    images), and the log of what was left out."""
    from stages.examples import STAGE_FORMS, held_out, read_examples

    cfg, key = stage.cfg, stage.name
    form = STAGE_FORMS[key]
    train, dropped = read_examples(cfg.data, f"{key}.data", tokenizer, form, cfg.max_len, processor)
    if cfg.eval_data:
        evaluation, dropped_eval = read_examples(cfg.eval_data, f"{key}.eval_data", tokenizer, form, cfg.max_len,
                                                 processor)
        dropped += dropped_eval
    else:
        train, evaluation = held_out(train, cfg.eval_fraction, stage.seed)
    if dropped:
        stage.log.warning("%s: %d rows longer than max_len (%d tokens) or with nothing to learn left out", key,
                          dropped, cfg.max_len)
    stage.log.info("%s: %d training examples, %d held out", key, len(train), len(evaluation))
    return train, evaluation


def epochs_of(count: int, stage: Stage) -> Iterator[tuple[int, torch.Tensor]]:
    """(epoch, batch) for every optimizer step of the stage."""
    for epoch in range(stage.cfg.epochs):
        for indices in batches(count, stage, epoch):
            yield epoch, indices


def forget_stage_metrics(run_dir: str, name: str) -> None:
    """A stage trained again starts its metrics over (RUN_DIR/metrics/<name>.jsonl, its TensorBoard)."""
    path = os.path.join(run_dir, "metrics", f"{name}.jsonl")
    if os.path.exists(path):
        os.remove(path)
    shutil.rmtree(os.path.join(run_dir, "tensorboard", name), ignore_errors=True)
