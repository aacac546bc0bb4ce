"""`tether run`: every role as its own OS process, placed on its devices, watched until the learner
is done. A role that dies takes the run down with a non-zero exit and its last log lines."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import deque

from common.config import STAGES, TetherConfig, dump_config
from common.runlog import StartupTimeline, read_metrics, stage_files
from launch.exit_codes import ExitCode, describe, run_exit_code, signalled
from launch.processes import DIST_ENV_KEYS, STOP_SIGNALS, RoleProcess, Stopped, role_command, role_name
from launch.trackers import STATE_FILE as TRACKERS_STATE
from launch.trackers import Trackers

SHUTDOWN_GRACE_S = 60.0  # after the learner is done, time for the others to hear "stop" and exit
TERMINATE_GRACE_S = 10.0
RESTARTABLE = ("rollout", "scorer")  # their state is in the buffer; the buffer and learner hold it
NOT_RESTARTED = (ExitCode.CONFIG_ERROR, ExitCode.ENVIRONMENT_FAILED)  # a restart would end the same way


class LocalProcess:
    """A role's process on this host, the leader of its own process group (vLLM's workers, torchrun's
    ranks): what `tether run` watches, signals and stops. ``launch.ray_cluster.RayProcess`` is the
    same on a node Ray placed it on."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen, self.pid = popen, popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout=timeout)

    def signal(self, number: int) -> None:
        """To every process of the group."""
        try:
            os.killpg(self.pid, number)
        except ProcessLookupError:
            pass

    def group_alive(self) -> bool:
        """Whether any process of the group is left (vLLM's workers outlive a killed parent)."""
        return _group_alive(self.pid)


COLOCATED_SPINCOUNT = 10_000  # spins of an idle OpenMP worker before it sleeps, colocated (bench/omp_wait.py)


def _role_env(config: TetherConfig, role: str, worker_index: int) -> dict[str, str]:
    env = dict(os.environ)
    # `tether run` starts the learner's ranks with torch.distributed's launcher: a rendezvous
    # inherited from the caller (a port another process holds) must not leak into it.
    for key in DIST_ENV_KEYS:
        env.pop(key, None)
    env["PYTHONUNBUFFERED"] = "1"
    cores = config.cores_of(role, worker_index)
    if cores:
        processes = config.learner.ranks if role == "learner" else 1
        env["OMP_NUM_THREADS"] = str(max(1, len(cores) // processes))
    if config.colocated:
        # a role waiting for its shift must leave the cores to the one computing: OpenMP's workers
        # spin 300,000 times after a parallel region by default, which made roles sharing cores 2.7
        # times slower here (docs/proposals/issue-37-colocate.md). Passive, they sleep at once,
        # and waking them for every op made a small matmul 3 times slower (bench/omp_wait.py); a
        # short spin (GNU OpenMP's count, which overrides the policy's 0) keeps both. The caller's
        # environment wins.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env.setdefault("GOMP_SPINCOUNT", str(COLOCATED_SPINCOUNT))
    devices = config.cuda_devices_of(role, worker_index)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    return env


def start_role(config: TetherConfig, role: str, config_path: str, worker_index: int = 0) -> RoleProcess:
    """Worker ``worker_index`` of ``role`` as a process of this host."""
    name = role_name(role, worker_index)
    log_path = os.path.join(config.run_dir, "logs", f"{name}.log")
    process = _spawn(role_command(role, config_path, worker_index), log_path, config, role, worker_index)
    return RoleProcess(name, role, worker_index, LocalProcess(process), log_path)


def _spawn(command: list[str], log_path: str, config: TetherConfig, role: str, worker_index: int) -> subprocess.Popen:
    """``command`` placed as worker ``worker_index`` of ``role`` (cores, environment), its output
    appended to ``log_path``, in a process group of its own: vLLM's workers die with it."""
    cores = config.cores_of(role, worker_index)

    def place() -> None:  # runs in the child before exec
        if cores:
            os.sched_setaffinity(0, cores)

    with open(log_path, "ab") as log_file:
        return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                env=_role_env(config, role, worker_index), preexec_fn=place, start_new_session=True)


def _write_pids(run_dir: str, roles: list[RoleProcess]) -> None:
    """RUN_DIR/pids.json: each role's process (group) id, for operators and for tests."""
    with open(os.path.join(run_dir, "pids.json.tmp"), "w") as file:
        json.dump({role.name: role.process.pid for role in roles}, file)
    os.replace(os.path.join(run_dir, "pids.json.tmp"), os.path.join(run_dir, "pids.json"))


def _group_alive(pgid: int) -> bool:
    """Whether any process of a role's group is left (vLLM's workers outlive a killed parent)."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as file:
            return "".join(deque(file, maxlen=lines))
    except OSError:
        return ""


def _stop_learner_first(roles: list[RoleProcess], grace_s: float) -> None:
    """Stop the learner first, as a scheduler that preempts the run would: on SIGTERM it writes a
    checkpoint (through the buffer, which must still be there) and exits; ``tether run --resume``
    continues from it. Then every other role."""
    learners = [role for role in roles if role.role == "learner" and role.process.poll() is None]
    for role in learners:
        print(f"tether run: asking {role.name} to checkpoint and stop (up to {grace_s:.0f}s)", file=sys.stderr,
              flush=True)
        role.process.signal(signal.SIGTERM)
        try:
            role.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            print(f"tether run: {role.name} did not stop within {grace_s:.0f}s (launch.checkpoint_grace_s)",
                  file=sys.stderr, flush=True)
    _stop(roles)


def _stop(roles: list[RoleProcess], at_once: tuple[str, ...] = ()) -> None:
    """SIGTERM to every role (SIGKILL to those of the roles ``at_once``), SIGKILL to what is left
    after ``TERMINATE_GRACE_S``."""
    for role in roles:
        if role.process.poll() is None or role.process.group_alive():
            role.process.signal(signal.SIGKILL if role.role in at_once else signal.SIGTERM)
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for role in roles:
        try:
            role.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            role.process.signal(signal.SIGKILL)
            role.process.wait()
    # the leader's children (vLLM's engine and workers) may outlive it by a moment, or ignore SIGTERM;
    # a zombie nobody reaps (a container whose init does not) would keep its group: give up after a kill
    for role in roles:
        killed = False
        while role.process.group_alive():
            if time.monotonic() > deadline:
                if killed:
                    print(f"tether run: processes of {role.name}'s group {role.process.pid} are still listed after "
                          "SIGKILL (zombies?)", file=sys.stderr, flush=True)
                    break
                role.process.signal(signal.SIGKILL)
                killed, deadline = True, time.monotonic() + TERMINATE_GRACE_S
            time.sleep(0.1)


def _remove_shared_memory(config: TetherConfig) -> None:
    """Published weights live in RAM (/dev/shm) until deleted; a stopped run needs none of them. Nor
    what a killed vLLM engine left there (``remove_orphan_shared_memory``)."""
    for directory in [config.weights_dir, *glob.glob(config.weights_dir + "-rollout*")]:
        shutil.rmtree(directory, ignore_errors=True)
    remove_orphan_shared_memory()


# Python's multiprocessing names its shared memory and semaphores so; vLLM's engine queues are of it
ORPHAN_PREFIXES = ("psm_", "sem.mp-")


def remove_orphan_shared_memory(directory: str = "/dev/shm", min_age_s: float = 10.0) -> list[str]:
    """Remove this user's multiprocessing shared-memory files that no live process maps or holds
    open: a killed engine never unlinks its queues (160-240 MiB each with vLLM), and they hold RAM
    until the machine restarts. Younger than ``min_age_s``: kept (being created, not yet mapped).
    Returns the paths removed."""
    candidates = []
    now = time.time()
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        path = os.path.join(directory, name)
        if name.startswith(ORPHAN_PREFIXES):
            try:
                info = os.stat(path)
            except FileNotFoundError:
                continue
            if info.st_uid == os.getuid() and now - info.st_mtime >= min_age_s:
                candidates.append(path)
    if not candidates:
        return []
    in_use = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                in_use.update(line.split(None, 5)[-1].strip() for line in maps if directory in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                in_use.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # gone meanwhile, or another user's
            continue
    removed = []
    for path in candidates:
        if path not in in_use:
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


def _raise_stopped(number: int, frame) -> None:
    raise Stopped(number)


class Evaluations:
    """``tether eval`` on the learner's exports (``checkpoints/eval-step-N``, every ``eval.every``
    steps), one at a time beside training, each export removed once evaluated; then on
    ``checkpoints/final``. An evaluation that fails is reported, and training goes on."""

    def __init__(self, config: TetherConfig, config_path: str) -> None:
        self.config, self.config_path = config, config_path
        self.enabled = bool(config.eval.every and config.eval.prompts)
        self.log_path = os.path.join(config.run_dir, "logs", "eval.log")
        self.current: subprocess.Popen | None = None
        self.current_export: str | None = None
        self.deadline = 0.0  # when the running evaluation is stopped
        self.started: set[str] = set()

    def poll(self) -> None:
        """Start the next export's evaluation when none runs."""
        if not self.enabled or self._running():
            return
        pending = sorted(path for path in glob.glob(os.path.join(self.config.run_dir, "checkpoints", "eval-step-*"))
                         if not path.endswith(".tmp") and path not in self.started)
        if pending:
            self._start(pending[0], int(pending[0].rsplit("-", 1)[1]), remove=True)

    def finish(self) -> None:
        """Evaluate what is left, then the final policy; waits for each."""
        if not self.enabled:
            return
        while True:
            self.poll()
            if not self._running():
                break
            self._wait()
        final = os.path.join(self.config.run_dir, "checkpoints", "final")
        if os.path.isdir(final):
            self._start(final, self.config.learner.total_steps, remove=False)
            self._wait()
            self._running()

    def _wait(self) -> None:
        """Until the running evaluation ends, or its ``eval.deadline_s`` passes (then it is stopped)."""
        try:
            self.current.wait(timeout=max(0.1, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._running()

    def stop(self) -> None:
        if self.current is not None and _group_alive(self.current.pid):  # vLLM's workers too
            os.killpg(self.current.pid, signal.SIGKILL)
            self.current.wait()

    def _running(self) -> bool:
        if self.current is None:
            return False
        code = self.current.poll()
        if code is None and time.monotonic() > self.deadline:
            print(f"tether run: an evaluation ran past eval.deadline_s ({self.config.eval.deadline_s:.0f}s); "
                  "stopping it", file=sys.stderr, flush=True)
            self.stop()
            code = self.current.poll()
        if code is None:
            return True
        if code != 0:
            print(f"tether run: an evaluation exited with code {code}; last lines of {self.log_path}:\n"
                  f"{_tail(self.log_path, 8)}", file=sys.stderr, flush=True)
            if self.current_export is not None:  # a full copy of the model: not left behind
                shutil.rmtree(self.current_export, ignore_errors=True)
        self.current = None
        return False

    def _start(self, checkpoint: str, step: int, remove: bool) -> None:
        self.started.add(checkpoint)
        self.current_export = checkpoint if remove else None
        command = [sys.executable, "-m", "launch.cli", "eval", checkpoint, "--config", self.config_path,
                   "--step", str(step), *(["--remove"] if remove else [])]
        self.current = _spawn(command, self.log_path, self.config, "rollout", 0)  # beside the first engine
        self.deadline = time.monotonic() + self.config.eval.deadline_s


def _progress_line(record: dict, total_steps: int) -> str:
    """One learner step on the console; the bound k too (it moves under buffer.max_staleness: auto),
    and why it moved at the step it did."""
    line = (f"step {record['step']}/{total_steps} | reward {record['reward']:+.3f} | kl {record['kl']:.4f} | "
            + (f"teacher kl {record['teacher_kl']:.4f} | " if record.get("teacher_kl") is not None else "")
            + f"len {record['response_length']:.1f} | samples/s {record['samples_per_s']:.1f} | "
            f"staleness {record['staleness']:.2f}")
    if record.get("max_staleness") is not None:
        line += f" (k {record['max_staleness']})"
    if record.get("staleness_change"):
        line += f" | k changed: {record['staleness_change']}"
    return line


def _forget_steps_after(run_dir: str, version: int) -> None:
    """On resume, the learner's records and evaluations past the checkpoint belong to the lost
    future: drop them (and the policy exports waiting for evaluation) so the run reads as one."""
    for name in ("learner", "eval"):
        path = os.path.join(run_dir, "metrics", f"{name}.jsonl")
        if os.path.exists(path):
            kept = [record for record in read_metrics(run_dir, name) if record.get("step", 0) <= version]
            with open(path + ".tmp", "w") as file:
                file.writelines(json.dumps(record) + "\n" for record in kept)
            os.replace(path + ".tmp", path)
    for export in glob.glob(os.path.join(run_dir, "checkpoints", "eval-step-*")):
        if export.endswith(".tmp") or int(export.rsplit("-", 1)[1]) > version:
            shutil.rmtree(export, ignore_errors=True)


def run_roles(config: TetherConfig, overwrite: bool = False, resume: bool = False, ray: str | None = None) -> int:
    """Every role of ``config`` as its own process, watched until the learner is done: on this host,
    or with ``ray`` (a cluster's address; "" for a cluster of this machine alone) wherever Ray
    places each (``launch.ray_cluster``). Returns the exit code."""

    run_dir = config.run_dir
    kept = set().union(*(stage_files(name) for name in STAGES))  # tether pipeline's stages ran here first
    previous = [os.path.join(name, entry) for name in ("metrics", "logs", "tensorboard", "checkpoints")
                if os.path.isdir(os.path.join(run_dir, name)) for entry in sorted(os.listdir(os.path.join(run_dir, name)))
                if os.path.join(name, entry) not in kept]
    if resume:
        with open(os.path.join(config.resume_from, "COMPLETE")) as file:
            version = int(file.read())
        _forget_steps_after(run_dir, version)
        print(f"tether run: resuming {run_dir} from {config.resume_from} (policy version {version})", flush=True)
    elif previous:
        if not overwrite:
            held = sorted({entry.split(os.sep)[0] for entry in previous})
            print(f"error: run_dir {run_dir} already holds a run ({', '.join(held)}); choose another "
                  "run_dir or pass --overwrite", file=sys.stderr)
            return ExitCode.CONFIG_ERROR
        for entry in previous:
            path = os.path.join(run_dir, entry)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    if not resume and os.path.exists(os.path.join(run_dir, TRACKERS_STATE)):
        os.remove(os.path.join(run_dir, TRACKERS_STATE))  # a new run is a new tracker run; --resume goes on in its own
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    os.makedirs(os.path.join(run_dir, "metrics"), exist_ok=True)
    config_path = os.path.join(run_dir, "config.yaml")
    with open(config_path, "w") as file:
        file.write(dump_config(config))

    timeline = StartupTimeline(run_dir, "tether run")
    trackers = Trackers(config).start()  # wandb / mlflow / trackio, where metrics.trackers names them
    try:
        if ray is None:
            return _watch(config, config_path, resume, timeline, start_role)
        from launch.ray_cluster import RayPlacement

        # Ray's placement waits up to minutes for room: a signal stops it, as it stops the run. The
        # handler only notes it (an exception raised inside Ray's C wait comes out as a SystemError);
        # the placement looks between its waits of a second
        received: list[int] = []
        handlers = {number: signal.signal(number, lambda number, _: received.append(number))
                    for number in STOP_SIGNALS}
        try:
            placement = RayPlacement(config, config_path, ray, stop=lambda: received[0] if received else None)
        except Stopped as stop:
            print(f"tether run: {stop} while Ray placed the processes; nothing was started", file=sys.stderr,
                  flush=True)
            return signalled(stop.signal)
        finally:
            for number, handler in handlers.items():
                signal.signal(number, handler)
        try:
            return _watch(config, config_path, resume, timeline, placement.start_role)
        finally:
            placement.close()
    finally:
        trackers.close()


def _watch(config: TetherConfig, config_path: str, resume: bool, timeline: StartupTimeline, start) -> int:
    """Start every role with ``start(config, role, config_path, worker_index)``, then watch them:
    progress, restarts of rollouts and scorers, the end of the run, Ctrl-C and SIGTERM."""
    run_dir = config.run_dir
    roles = [start(config, "buffer", config_path)]
    roles += [start(config, "scorer", config_path, i) for i in range(config.scorer.workers)]
    roles += [start(config, "rollout", config_path, i) for i in range(config.rollout.engines)]
    roles += [start(config, "learner", config_path)]
    learner = roles[-1]
    timeline.phase("start roles")  # this process's start-up, config checks and the roles' launch
    _write_pids(run_dir, roles)
    print(f"tether run: {len(roles)} processes, logs in {run_dir}/logs, metrics in {run_dir}/metrics", flush=True)

    shown_steps = len(read_metrics(run_dir, "learner")) if resume else 0
    learner_done_at: float | None = None
    evaluations = Evaluations(config, config_path)
    # what a scheduler, `timeout` or a closed terminal sends: stop every role as Ctrl-C does. SIGINT too:
    # a shell starts a background job with it ignored, and `kill -INT` must still stop the run
    previous_handlers = {number: signal.signal(number, _raise_stopped) for number in STOP_SIGNALS}
    try:
        while True:
            time.sleep(0.5)
            evaluations.poll()
            records = read_metrics(run_dir, "learner")
            for record in records[shown_steps:]:
                print(_progress_line(record, config.learner.total_steps), flush=True)
            shown_steps = len(records)

            for index, role in enumerate(roles):
                code = role.process.poll()
                if code in (None, 0):
                    continue
                if (role.role in RESTARTABLE and role.restarts < config.launch.max_restarts and learner_done_at is None
                        and code not in NOT_RESTARTED):
                    delay = config.launch.restart_backoff_s * 2 ** role.restarts
                    print(f"tether run: {role.name} exited with {describe(code)}; restarting it in {delay:.0f}s "
                          f"({role.restarts + 1} of {config.launch.max_restarts}); last lines:\n"
                          f"{_tail(role.log_path, 5)}", file=sys.stderr, flush=True)
                    time.sleep(delay)
                    if role.process.group_alive():  # what the dead one left (vLLM's engine process)
                        role.process.signal(signal.SIGKILL)
                    remove_orphan_shared_memory()  # and its engine's queues in /dev/shm
                    replacement = start(config, role.role, config_path, role.worker_index)
                    replacement.restarts = role.restarts + 1
                    roles[index] = replacement
                    _write_pids(run_dir, roles)
                    continue
                print(f"tether run: {role.name} exited with {describe(code)}; last lines of {role.log_path}:\n"
                      f"{_tail(role.log_path)}", file=sys.stderr, flush=True)
                if role.role == "buffer":  # a checkpoint holds the buffer's state: the learner cannot write one
                    print("tether run: without the buffer the learner cannot checkpoint; `tether run --resume` goes "
                          "on from its newest checkpoint", file=sys.stderr, flush=True)
                    _stop(roles, at_once=("learner",))
                else:  # the learner checkpoints through the buffer while it is still there, as on Ctrl-C
                    _stop_learner_first(roles, config.launch.checkpoint_grace_s)
                evaluations.stop()
                _remove_shared_memory(config)
                return run_exit_code(code)
            if learner.process.poll() == 0 and learner_done_at is None:
                learner_done_at = time.monotonic()
            if learner_done_at is not None:
                if all(role.process.poll() is not None for role in roles):
                    _stop(roles)  # what a role's leader left in its group (none, normally) goes too
                    _remove_shared_memory(config)
                    timeline.phase("run")
                    evaluations.finish()
                    print(f"tether run: done; final policy in {run_dir}/checkpoints/final", flush=True)
                    return ExitCode.OK
                if time.monotonic() - learner_done_at > SHUTDOWN_GRACE_S:
                    stragglers = [role.name for role in roles if role.process.poll() is None]
                    print(f"tether run: {', '.join(stragglers)} did not stop within {SHUTDOWN_GRACE_S:.0f}s; "
                          "terminating", file=sys.stderr, flush=True)
                    _stop(roles)
                    _remove_shared_memory(config)
                    evaluations.finish()
                    return ExitCode.OK
    except (KeyboardInterrupt, Stopped) as stop:
        print(f"tether run: {stop or 'interrupted'}, stopping every role", file=sys.stderr, flush=True)
        _stop_learner_first(roles, config.launch.checkpoint_grace_s)
        evaluations.stop()
        _remove_shared_memory(config)
        return signalled(stop.signal) if isinstance(stop, Stopped) else signalled(signal.SIGINT)
    finally:
        for number, handler in previous_handlers.items():
            signal.signal(number, handler)
