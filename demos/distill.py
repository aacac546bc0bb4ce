"""`tether demo --distill`: on-policy distillation on the parity task. The teacher is the policy the
parity demo's PPO trains (built once, as the demo builds it: `configs/demo.yaml`); the student is
the SFT policy. The student samples, the scorer grades each of its tokens with the teacher's
logprob, and the learner trains each token on its reverse KL to the teacher
(`configs/demo-distill.yaml`: `learner.distill_only`). No reward model is read.

Reported: held-out gold of the SFT policy, the teacher and the student, and the samples each run
trained before its training gold first reached 0.9 of the teacher's held-out gold: distillation's
against the teacher's own PPO run's.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from demos.parity import ASSETS_VERSION, build_assets, built_once, held_out_figures, run_config
from launch.exit_codes import ExitCode

REACH = 0.9  # of the teacher's held-out gold


def build_teacher(assets: Path, paths: dict[str, str], log=print) -> str:
    """The parity demo's PPO run from the SFT policy (configs/demo.yaml), its final policy kept as
    the teacher, with the run's metrics (PPO's curve) beside it."""
    from common.config import load_config
    from launch.runner import run_roles

    directory = assets / "teacher"

    def build() -> None:
        config = load_config(Path(__file__).resolve().parent.parent / "configs" / "demo.yaml",
                             [f"models.policy={paths['policy']}", f"models.reward={paths['reward']}",
                              f"data.prompts={paths['prompts']}", f"run_dir={directory / 'run'}"])
        code = run_roles(config, overwrite=True)
        if code != 0:
            raise RuntimeError(f"the teacher's PPO run failed ({code}): {directory / 'run'}")
        shutil.copytree(directory / "run" / "checkpoints" / "final", directory / "policy", dirs_exist_ok=True)

    built_once(directory, {"version": ASSETS_VERSION, "teacher": 1},
               {"teacher": str(directory / "policy")}, "demo teacher (the parity demo's PPO)", build, log)
    return str(directory / "policy")


def samples_to_reach(run_dir: str, goal: float, batch_size: int) -> int | None:
    """Samples trained before the learner's training gold first reached ``goal`` (None: never)."""
    from common.runlog import read_metrics

    for record in read_metrics(run_dir, "learner"):
        if record.get("gold_reward") is not None and record["gold_reward"] >= goal:
            return record["step"] * batch_size
    return None


def run_demo(assets: Path, overrides: list[str]) -> int:
    started = time.monotonic()
    paths = build_assets(assets / "assets")
    teacher = build_teacher(assets / "assets", paths)
    config_path = Path(__file__).resolve().parent.parent / "configs" / "demo-distill.yaml"
    config = run_config(config_path, [f"models.policy={paths['policy']}", f"models.teacher={teacher}",
                                      f"data.prompts={paths['prompts']}", *overrides])
    if isinstance(config, int):
        return config
    figures = {name: held_out_figures(policy, paths["policy"], paths["reward"], paths["eval_prompts"],
                                      config.rollout.max_new_tokens)
               for name, policy in (("sft", paths["policy"]), ("teacher", teacher),
                                    ("student", os.path.join(config.run_dir, "checkpoints", "final")))}
    goal = REACH * figures["teacher"]["gold_reward"]
    teacher_run = str(Path(teacher).parent / "run")
    with open(os.path.join(teacher_run, "config.yaml")) as file:
        import yaml

        teacher_batch = yaml.safe_load(file)["learner"]["batch_size"]
    report = {**figures, "goal": goal,
              "samples_to_goal": {"distillation": samples_to_reach(config.run_dir, goal, config.learner.batch_size),
                                  "ppo": samples_to_reach(teacher_run, goal, teacher_batch)},
              "elapsed_s": time.monotonic() - started}
    with open(os.path.join(config.run_dir, "demo_report.json"), "w") as file:
        json.dump(report, file, indent=2)
    print(f"\nheld-out prompts ({paths['eval_prompts']}):")
    print(f"{'policy':<9}{'gold':>8}{'kl':>8}{'length':>8}")
    for name in ("sft", "teacher", "student"):
        row = figures[name]
        print(f"{name:<9}{row['gold_reward']:>8.3f}{row['kl_to_reference']:>8.3f}{row['response_length']:>8.2f}")
    reached = report["samples_to_goal"]
    print(f"samples trained to a training gold of {goal:.3f} ({REACH} x the teacher's): distillation "
          f"{reached['distillation']}, the teacher's PPO {reached['ppo']}; {report['elapsed_s']:.0f}s in all")
    print(f"results: {config.run_dir} (metrics/, logs/, checkpoints/final, demo_report.json)")
    return ExitCode.OK
