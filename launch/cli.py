"""The `tether` command. Each command parses, validates and calls one `run`; heavy modules (torch,
vLLM, DeepSpeed) are imported only inside, so `tether --help` answers at once."""

from __future__ import annotations

import os
import sys
from enum import Enum
from pathlib import Path
from typing import NoReturn, Optional

import typer

from launch.exit_codes import ExitCode, signalled

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="markdown",
                  help="tether: asynchronous PPO-RLHF with vLLM, DeepSpeed and ZeroMQ.")
config_app = typer.Typer(no_args_is_help=True, rich_markup_mode="markdown", help="Inspect configs.")
app.add_typer(config_app, name="config")

ConfigOption = typer.Option(..., "--config", "-c", help="YAML or TOML config file")
OverrideOption = typer.Option(None, "--override", "-o", help="key.subkey=value, repeatable")


class Role(str, Enum):
    buffer = "buffer"
    rollout = "rollout"
    scorer = "scorer"
    learner = "learner"


@app.callback()
def _user_code_importable() -> None:
    """The user's reward functions, tools and environments are imported from where tether runs, as
    ``python -m`` would find them: the console script's own path holds only its bin directory. The
    processes it starts (roles, ranks, vLLM's, Ray's) inherit the directory through PYTHONPATH."""
    # no "Loading weights" bar per model load in any tether process: a role's load is a line of its
    # log (common.models turns the hub's bars back on for a download, which is long work)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    here = os.getcwd()
    if here not in sys.path:
        sys.path.append(here)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(path for path in (*paths, here) if path)


def fail(message: object, code: ExitCode, label: str = "error") -> NoReturn:
    """The one way a command reports an error: ``label: message`` on stderr, then exit ``code``."""
    typer.echo(f"{label}: {message}", err=True)
    raise typer.Exit(code)


def _load(config: Path, override: Optional[list[str]], ppo: bool = True, saved: bool = False):
    """The config, validated; with ``ppo``, one that says what PPO needs (models, data); ``saved``:
    a run's own config.yaml (``load_config``)."""
    from common.config import ConfigError, load_config

    try:
        resolved = load_config(config, override or [], saved=saved)
        return resolved.require_ppo(f"tether {sys.argv[1] if len(sys.argv) > 1 else 'run'}") if ppo else resolved
    except ConfigError as error:
        fail(error, ExitCode.CONFIG_ERROR)


@app.command()
def launch(role: Role = typer.Argument(..., help="which role this process runs"),
           config: Path = ConfigOption, override: Optional[list[str]] = OverrideOption,
           worker_index: int = typer.Option(0, help="index of this rollout engine or scorer in its pool"),
           nnodes: int = typer.Option(1, help="learner: hosts the DeepSpeed job spans"),
           node_rank: int = typer.Option(0, help="learner: this host's index among them (0 talks to the buffer)"),
           master_addr: str = typer.Option("127.0.0.1", help="learner: address of the node-rank-0 host"),
           master_port: int = typer.Option(0, help="learner: its torch.distributed port (0: learner.dist_port, "
                                                   "or a free one on a single host)")) -> None:
    """Run one role in the foreground; logs to stderr, metrics to RUN_DIR/metrics. A learner of
    several ranks (learner.ranks, or --nnodes) starts them through torch.distributed's launcher."""
    resolved = _load(config, override)
    from common.config import ConfigError
    from protocol.transport import BufferUnreachable

    try:
        if role is Role.buffer:
            from buffer.main import BufferStopped, run
            try:
                run(resolved)
            except BufferStopped as error:  # `tether run` stopping the run: the accounting is written
                fail(error, signalled(error.signal), label="stopped")
        elif role is Role.rollout:
            from rollout.engine import EngineNeedsRestart
            from rollout.episodes import EnvironmentFailing
            from rollout.main import run
            try:
                run(resolved, worker_index)
            except EngineNeedsRestart as error:  # `tether run` starts it again
                fail(error, ExitCode.FAILED)
            except EnvironmentFailing as error:  # `tether run` ends the run with it
                fail(error, ExitCode.ENVIRONMENT_FAILED, label="stopped")
        elif role is Role.scorer:
            from scorer.main import run
            run(resolved, worker_index)
        elif "RANK" not in os.environ and (resolved.learner.ranks > 1 or nnodes > 1):
            from launch.ranks import launch_ranks
            raise typer.Exit(launch_ranks(resolved, sys.argv[1:], nnodes, node_rank, master_addr, master_port))
        else:
            from learner.main import TrainingStopped, run
            from training.signals import Preempted
            try:
                run(resolved)
            except TrainingStopped as error:
                fail(error, ExitCode.TRAINING_STOPPED, label="stopped")
            except Preempted as error:
                fail(error, signalled(error.signal), label="stopped")
    except (ConfigError, BufferUnreachable) as error:
        fail(error, ExitCode.CONFIG_ERROR if isinstance(error, ConfigError) else ExitCode.FAILED)
    exit_finished()


def exit_finished() -> None:
    """End a role whose run is over, with everything it writes closed, without the interpreter's
    teardown: freeing torch's, vLLM's and DeepSpeed's modules object by object took 1 to 2.4 s a
    role here, and `tether run` ends when its last role does. Logs are flushed and ZeroMQ first
    delivers what is queued, for at most the sockets' linger (a socket left open must not hang the
    exit)."""
    import logging
    import threading

    import zmq

    from protocol.transport import LINGER_MS

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    delivering = threading.Thread(target=zmq.Context.instance().term, name="zmq-term", daemon=True)
    delivering.start()
    delivering.join(LINGER_MS / 1000)
    os._exit(0)


@app.command("run")
def run_all(config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML or TOML config file"),
            override: Optional[list[str]] = OverrideOption,
            overwrite: bool = typer.Option(False, help="replace a previous run in the same run_dir"),
            resume: Optional[Path] = typer.Option(None, help="continue RUN_DIR from its newest complete checkpoint"),
            ray: bool = typer.Option(False, "--ray", help="place every process on a Ray cluster (placement.ray): "
                                                          "--ray-address's, else RAY_ADDRESS's, else one started "
                                                          "on this machine"),
            ray_address: Optional[str] = typer.Option(None, help="the Ray cluster's address (HOST:PORT, "
                                                                  "ray://HOST:10001, auto); implies --ray")) -> None:
    """Start every role as its own process, show progress, stop them all when the learner is done."""
    saved = resume is not None and config is None  # the run's own config.yaml
    if resume is not None:
        from training.checkpoints import newest_state

        state = newest_state(str(resume))
        if state is None:
            fail(f"{resume}/checkpoints holds no complete checkpoint (learner.checkpoint_every)", ExitCode.CONFIG_ERROR)
        config = config or resume / "config.yaml"
        override = [*(override or []), f"run_dir={resume}", f"resume_from={state}"]
    elif config is None:
        fail("--config is needed (or --resume RUN_DIR)", ExitCode.CONFIG_ERROR)
    resolved = _load(config, override, saved=saved)
    from common.config import ConfigError
    from common.model_dirs import resolve_models

    from launch.preflight import check_placement, check_run_data

    address = ray_address if ray_address is not None else ("" if ray else None)
    try:  # before any process starts: a hub id is fetched once here, the roles then find it cached
        if address is None:  # on Ray, no core of this host is named
            check_placement(resolved)
        for role in ("rollout", "scorer", "learner"):
            resolve_models(resolved, role)
        check_run_data(resolved)
    except ConfigError as error:
        fail(error, ExitCode.CONFIG_ERROR)
    from launch.runner import run_roles

    try:
        code = run_roles(resolved, overwrite, resume=resume is not None, ray=address)
    except ConfigError as error:  # Ray missing, or no room on the cluster
        fail(error, ExitCode.CONFIG_ERROR)
    raise typer.Exit(code)


StageOverwrite = typer.Option(False, "--overwrite", help="train from the start, even where the output already "
                                                            "holds this stage's model or a saved state of it")


def _run_stage(name: str, config: Path, override: Optional[list[str]], overwrite: bool) -> None:
    """`tether sft|rm|dpo`: the stage's ``run`` on this process, or its ranks through torchrun."""
    resolved = _load(config, override, ppo=False)
    from common.config import ConfigError
    from training.signals import Preempted

    try:
        section = resolved.stage(name)
        if "RANK" not in os.environ and section.ranks > 1:
            from launch.ranks import launch_ranks

            raise typer.Exit(launch_ranks(resolved, sys.argv[1:], 1, 0, "127.0.0.1", 0, section, name))
        from launch.pipeline import run_stage

        output = run_stage(resolved, name, overwrite)
    except ConfigError as error:
        fail(error, ExitCode.CONFIG_ERROR)
    except FloatingPointError as error:
        fail(error, ExitCode.TRAINING_STOPPED, label="stopped")
    except Preempted as error:
        fail(error, signalled(error.signal), label="stopped")
    if int(os.environ.get("RANK", 0)) == 0:
        typer.echo(output)
    exit_finished()


@app.command()
def sft(config: Path = ConfigOption, override: Optional[list[str]] = OverrideOption,
        overwrite: bool = StageOverwrite) -> None:
    """Supervised fine-tuning on demonstrations (the config's sft section): an HF model directory
    for models.policy."""
    _run_stage("sft", config, override, overwrite)


@app.command()
def rm(config: Path = ConfigOption, override: Optional[list[str]] = OverrideOption,
       overwrite: bool = StageOverwrite) -> None:
    """The reward model on comparisons or K-wise rankings (the config's rm section), calibrated: an
    HF sequence-classification directory for models.reward."""
    _run_stage("rm", config, override, overwrite)


@app.command()
def dpo(config: Path = ConfigOption, override: Optional[list[str]] = OverrideOption,
        overwrite: bool = StageOverwrite) -> None:
    """DPO on preference pairs against a frozen reference (the config's dpo section)."""
    _run_stage("dpo", config, override, overwrite)


@app.command()
def pipeline(config: Path = ConfigOption, override: Optional[list[str]] = OverrideOption,
             overwrite: bool = typer.Option(False, help="train every stage again and replace a previous PPO run")
             ) -> None:
    """SFT, then the reward model, then PPO (and DPO where the config has a dpo section), each stage's
    output the next one's input; a stage already finished with the same section is not run again."""
    resolved = _load(config, override, ppo=False)
    from common.config import ConfigError
    from launch.pipeline import run_pipeline
    from launch.preflight import check_placement, check_run_data, check_stage_data

    try:  # every stage's data and PPO's before the first stage trains
        check_stage_data(resolved)
        if resolved.models is not None and resolved.data is not None:
            check_run_data(resolved)
            check_placement(resolved)
        code = run_pipeline(resolved, overwrite)
    except ConfigError as error:
        fail(error, ExitCode.CONFIG_ERROR)
    raise typer.Exit(code)


@app.command()
def demo(assets: Path = typer.Option(Path(".demo"), help="where the demo's models and data are built (cached)"),
         override: Optional[list[str]] = OverrideOption,
         long_tail: bool = typer.Option(False, help="responses of 4 to 64 tokens, most short "
                                                    "(configs/demo-long-tail.yaml)"),
         agent: bool = typer.Option(False, help="episodes with a calculator tool: sums the policy cannot do "
                                                "alone (configs/demo-agent.yaml)"),
         openai: bool = typer.Option(False, help="with --agent: the episodes are an agent program's, written "
                                                 "against the OpenAI API (demos/agent.py openai_agent)"),
         openenv: bool = typer.Option(False, help="with --agent: the calculator is an OpenEnv server's MCP tool "
                                                  "(demos/agent.py openenv_app, served by the demo)"),
         framework: Optional[str] = typer.Option(None, help="with --agent: the episodes are the task written with "
                                                            "an agent framework: openai-agents, anthropic, langgraph "
                                                            "or smolagents (demos/agent_frameworks.py)"),
         vision: bool = typer.Option(False, help="the parity read from an image: a policy that sees "
                                                 "(configs/demo-vision.yaml)"),
         judge: bool = typer.Option(False, help="an LLM judge on vLLM in the scorer in place of the reward "
                                                "model (configs/demo-judge.yaml)"),
         distill: bool = typer.Option(False, help="on-policy distillation: the SFT policy learns from the PPO "
                                                  "policy's logprobs (configs/demo-distill.yaml)")) -> None:
    """Build the demo's tokenizer, SFT policy and reward model (once), run PPO, report gold reward."""
    if judge or distill:
        if agent or openai or openenv or framework or long_tail or vision or (judge and distill):
            fail(f"tether demo --{'judge' if judge else 'distill'} is a demo of its own: without --agent, --openai, "
                 "--openenv, --framework, --long-tail, --vision, --judge or --distill", ExitCode.CONFIG_ERROR)
        if judge:
            from demos.judge import run_demo as run_judge_demo

            raise typer.Exit(run_judge_demo(assets, override or []))
        from demos.distill import run_demo as run_distill_demo

        raise typer.Exit(run_distill_demo(assets, override or []))
    if vision:
        if agent or openai or openenv or framework or long_tail:
            fail("tether demo --vision is a demo of its own: without --agent, --openai, --openenv, --framework or "
                 "--long-tail", ExitCode.CONFIG_ERROR)
        from demos.vision import run_demo as run_vision_demo

        raise typer.Exit(run_vision_demo(assets, override or []))
    if agent or openai or openenv or framework:
        from demos.agent import run_demo as run_agent_demo
        from demos.agent_frameworks import FRAMEWORKS, overrides

        if framework is not None and framework not in FRAMEWORKS:
            fail(f"--framework {framework}: one of {', '.join(FRAMEWORKS)}", ExitCode.CONFIG_ERROR)
        if sum(map(bool, (openai, openenv, framework))) > 1:
            fail("--openai, --openenv and --framework are each the agent demo's episodes another way: one at a time",
                 ExitCode.CONFIG_ERROR)
        variant = overrides(framework) if framework else []
        raise typer.Exit(run_agent_demo(assets, [*variant, *(override or [])], openai, openenv))
    from demos.parity import run_demo

    raise typer.Exit(run_demo(assets, override or [], long_tail))


@app.command("eval")
def evaluate(checkpoint: Path = typer.Argument(..., help="an HF model directory (checkpoints/final, an export)"),
             config: Path = ConfigOption, override: Optional[list[str]] = OverrideOption,
             step: int = typer.Option(0, help="the learner step the checkpoint belongs to (metrics' x axis)"),
             remove: bool = typer.Option(False, help="delete the checkpoint once evaluated (tether run's exports)")
             ) -> None:
    """Evaluate a checkpoint on eval.prompts: reward (RM and reward functions), KL to the reference,
    length and repetition into RUN_DIR/metrics/eval.jsonl, the worst responses into RUN_DIR/eval/."""
    from common.config import ConfigError
    from evaluator.main import run

    try:
        figures = run(_load(config, override), str(checkpoint), step)
    except ConfigError as error:
        fail(error, ExitCode.CONFIG_ERROR)
    typer.echo(" ".join(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
                        for key, value in figures.items()))
    if remove:
        import shutil

        shutil.rmtree(checkpoint, ignore_errors=True)


@app.command()
def replay(run_dir: Path = typer.Argument(..., help="a run made with learner.record_batches: true"),
           until: Optional[int] = typer.Option(None, help="the last step to replay; default: the run's last"),
           checkpoint: Optional[Path] = typer.Option(None, help="a checkpoints/state-N of the run to start from; "
                                                               "default: the start"),
           out: Optional[Path] = typer.Option(None, help="where the replay writes; default RUN_DIR/replay")) -> None:
    """Train the learner alone on the batches the run recorded, step for step, and compare each
    step's losses and the final weights with the run's."""
    from common.config import ConfigError
    from learner.main import replay as replay_run

    destination = out or run_dir / "replay"
    try:
        report = replay_run(str(run_dir), str(destination), until, str(checkpoint) if checkpoint else None)
    except (ConfigError, FileNotFoundError) as error:
        fail(error, ExitCode.CONFIG_ERROR)
    weights = report["max_weight_difference"]
    typer.echo(f"replayed steps {report['steps'][0]}..{report['steps'][-1]} into {destination}: largest difference "
               f"from the run's losses {report['max_metric_difference']:.3g}"
               + (f", from its final weights {weights:.3g}" if weights is not None else ""))
    exact = report["max_metric_difference"] == 0 and weights in (0.0, None)
    raise typer.Exit(ExitCode.OK if exact else ExitCode.FAILED)


@app.command()
def plot(run_dir: Path = typer.Argument(..., help="a run directory"),
         output: Optional[Path] = typer.Option(None, help="PNG path; default RUN_DIR/dashboard.png")) -> None:
    """One PNG dashboard: reward (RM, gold), KL, length, entropy, value loss, clip fraction,
    staleness and throughput against step."""
    from launch.report import plot_run

    try:
        path, _ = plot_run(str(run_dir), str(output) if output else None)
    except FileNotFoundError as error:
        fail(error, ExitCode.CONFIG_ERROR)
    typer.echo(path)


@app.command()
def track(config: Path = ConfigOption, override: Optional[list[str]] = OverrideOption) -> None:
    """Send a run's metrics, config and evaluations to metrics.trackers (wandb, mlflow, trackio) as the
    roles write them: for roles started by hand with tether launch (tether run does it itself).
    Ends when the learner has written its final policy, or on Ctrl-C."""
    from launch.trackers import follow

    raise typer.Exit(follow(_load(config, override, ppo=False)))


@app.command()
def profile(run_dir: Path = typer.Argument(..., help="a run directory")) -> None:
    """Each role's busy fraction, where its time went, the bottleneck and what to give more devices."""
    from launch.report import format_profile, profile_run

    try:
        typer.echo(format_profile(profile_run(str(run_dir))))
    except FileNotFoundError as error:
        fail(error, ExitCode.CONFIG_ERROR)


@app.command()
def status(run_dir: Path = typer.Argument(..., help="a run directory"),
           once: bool = typer.Option(False, help="print once and exit instead of refreshing"),
           interval: float = typer.Option(2.0, help="seconds between refreshes")) -> None:
    """A live view of a running pipeline: versions, buffer occupancy, per-role utilisation, alerts."""
    import time

    from rich.console import Console
    from rich.live import Live

    from launch.report import status_table

    if not os.path.isdir(run_dir) or not any(os.path.exists(os.path.join(run_dir, name))
                                             for name in ("config.yaml", "metrics")):
        fail(f"{run_dir} is not a tether run directory (it holds neither config.yaml nor metrics/)",
             ExitCode.CONFIG_ERROR)
    if once:
        Console().print(status_table(str(run_dir)))
        return
    with Live(status_table(str(run_dir)), refresh_per_second=1) as live:
        while not os.path.exists(os.path.join(run_dir, "metrics", "buffer_accounting.json")):
            time.sleep(interval)
            live.update(status_table(str(run_dir)))
        live.update(status_table(str(run_dir)))


@app.command()
def sweep(config: Path = ConfigOption, override: Optional[list[str]] = OverrideOption,
          split: list[str] = typer.Option(..., "--split", help="rollout=0;scorer=1;learner=1, repeatable; "
                                                               "rollout=0-1x2: two engines on cores 0-1; "
                                                               "colocate=0-1: every role on cores 0-1, working "
                                                               "in shifts (placement.mode colocate)"),
          staleness: str = typer.Option("0,1", help="max_staleness values, comma-separated"),
          steps: int = typer.Option(10, help="learner steps per trial"),
          gpus: bool = typer.Option(False, help="the split's numbers are GPU indices, not CPU cores"),
          out: Path = typer.Option(Path("runs/sweep"), help="one run directory per trial in here"),
          ray: bool = typer.Option(False, "--ray", help="each trial on a Ray cluster: a split's devices are counts "
                                                        "of CPUs (GPUs with --gpus) its processes ask for"),
          ray_address: Optional[str] = typer.Option(None, help="the Ray cluster's address; implies --ray")) -> None:
    """Short trials of one config over device splits and staleness bounds, ranked by trained tokens/s."""
    from launch.sweep import format_sweep, parse_counts, parse_split, run_sweep

    resolved = _load(config, override)
    try:
        for text in split:
            parse_split(text)
            parse_counts(text)
        bounds = [int(k) for k in staleness.split(",")]
    except ValueError as error:
        fail(error, ExitCode.CONFIG_ERROR)
    address = ray_address if ray_address is not None else ("" if ray else None)
    from common.config import ConfigError

    try:
        trials = run_sweep(resolved, split, bounds, steps, gpus, str(out), ray=address)
    except ConfigError as error:
        fail(error, ExitCode.CONFIG_ERROR)
    typer.echo(format_sweep(trials))


@app.command()
def plan(run_dirs: list[Path] = typer.Argument(..., help="finished runs whose profiles give each role's cost; "
                                                        "two runs where a role had different device counts give "
                                                        "its measured scaling"),
         devices: int = typer.Option(..., min=1, help="devices to split between rollout, scorer and learner"),
         check: Optional[Path] = typer.Option(None, help="a measured run: compare its tokens/s with the prediction")) -> None:
    """Predict the best split of N devices from the per-role costs measured in profiles."""
    from launch.sweep import check_line, measured_costs, measured_modes, plan_lines

    runs = [str(run_dir) for run_dir in run_dirs]
    try:
        costs = measured_costs(runs)
        lines = plan_lines(costs, devices, measured_modes(runs))
        if check is not None:
            lines.append(check_line(costs, str(check)))
    except FileNotFoundError as error:
        fail(error, ExitCode.CONFIG_ERROR)
    typer.echo("\n".join(lines))


@app.command()
def keys(directory: Path = typer.Argument(..., help="where to write the key pair"),
         name: str = typer.Argument(..., help="NAME.key (public) and NAME.key_secret (private)")) -> None:
    """Make a CURVE key pair for transport.curve (server_key, client_key, allowed_clients/)."""
    from protocol.security import make_keys

    public, secret = make_keys(str(directory), name)
    typer.echo(f"public key: {public}\nsecret key: {secret} (keep it private; mode 0600)")


@config_app.command("show")
def config_show(config: Path = ConfigOption, override: Optional[list[str]] = OverrideOption) -> None:
    """Print the resolved config, defaults filled in, each key with what it means."""
    from common.config import describe_config

    typer.echo(describe_config(_load(config, override, ppo=False)), nl=False)


def main() -> None:  # `python -m launch.cli`
    app()


if __name__ == "__main__":
    sys.exit(main())
