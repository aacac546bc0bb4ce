"""`tether pipeline`: InstructGPT's three stages from one config. SFT, then the reward model (and
DPO where the config has a dpo section), each as `tether <stage>` in a process of its own (its
ranks under torchrun), then PPO as `tether run` does it. Each stage's output is the next one's
input (``TetherConfig._chain_stages``). A stage whose output holds its model made from the same
section is not trained again, and PPO continues from its newest checkpoint, so a pipeline run
again after a failure picks up where it stopped; once a stage trains, every stage after it trains
anew (its input changed).
"""

from __future__ import annotations

import os
import subprocess
import sys

from common.config import STAGES, TetherConfig, dump_config
from launch.exit_codes import ExitCode
from stages import loop


def run_stage(config: TetherConfig, name: str, overwrite: bool = False) -> str:
    """Train stage ``name`` (this process is one rank of it) unless its output already holds the
    model of this recipe (then say so, and return it), going on from its saved state if it has
    one of this recipe; ``overwrite``: from the start, whatever is there. Returns the output."""
    from common.model_dirs import local_model_dir
    from stages import dpo, rm, sft  # in a stage's process only: `tether pipeline`'s own never trains

    section = config.stage(name)
    for key in ("model", "reference"):  # checked as `tether run` checks its models: a missing path is named
        if getattr(section, key, None):
            local_model_dir(f"{name}.{key}", getattr(section, key))
    output = config.stage_output(name)
    marker = loop.finished(output, loop.recipe_of(config, name))
    if marker is not None and not overwrite:
        print(f"{name}: {output} already holds this stage's model (held-out {marker['held_out']}); "
              "--overwrite trains it again", file=sys.stderr, flush=True)
        return output
    return {"sft": sft, "rm": rm, "dpo": dpo}[name].run(config, fresh=overwrite)


def run_pipeline(config: TetherConfig, overwrite: bool) -> int:
    """Every stage of ``config`` in order, then PPO when the config has its sections (models,
    data); returns the exit code of the first that fails, else PPO's."""
    run_dir = config.run_dir
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    resolved_path = os.path.join(run_dir, "pipeline.yaml")
    with open(resolved_path, "w") as file:  # each stage's process reads the same resolved config
        file.write(dump_config(config))
    for name in STAGES:
        if getattr(config, name) is None:
            continue
        output = config.stage_output(name)
        if not overwrite and loop.finished(output, loop.recipe_of(config, name)) is not None:
            print(f"tether pipeline: {name} is done ({output})", flush=True)
            continue
        overwrite = True  # a stage trained anew changes what every stage after it starts from
        print(f"tether pipeline: {name} -> {output}", flush=True)
        command = [sys.executable, "-m", "launch.cli", name, "-c", resolved_path, *(["--overwrite"] if overwrite else [])]
        code = _run_logged(command, os.path.join(run_dir, "logs", f"{name}.log"))
        if code != 0:
            print(f"tether pipeline: {name} failed (exit {code}); its log: {run_dir}/logs/{name}.log", flush=True)
            return code
    if config.models is None or config.data is None:
        return ExitCode.OK
    return _ppo(config, overwrite)


def _ppo(config: TetherConfig, overwrite: bool) -> int:
    """PPO on the stages' outputs: done if a final policy is there, resumed from the newest
    checkpoint if one is, else started (over whatever a run that saved nothing left)."""
    from common.model_dirs import resolve_models
    from launch.runner import run_roles
    from training.checkpoints import newest_state

    final = os.path.join(config.run_dir, "checkpoints", "final")
    if not overwrite and os.path.isdir(final):
        print(f"tether pipeline: ppo is done ({final})", flush=True)
        return ExitCode.OK
    state = None if overwrite else newest_state(config.run_dir)
    if state is not None:
        config = config.model_copy(update={"resume_from": state})
    for role in ("rollout", "scorer", "learner"):
        resolve_models(config, role)
    print(f"tether pipeline: ppo on {config.models.policy} against {config.models.reward}"
          + (f", resumed from {state}" if state else ""), flush=True)
    return run_roles(config, overwrite=True, resume=state is not None)


def _run_logged(command: list[str], log_path: str) -> int:
    """``command``'s output on the terminal and in ``log_path``; its exit code."""
    with open(log_path, "w") as log, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                      text=True, bufsize=1) as process:
        for line in process.stdout:
            sys.stdout.write(line)
            log.write(line)
        return process.wait()
