"""`tether run --ray`: every tether process placed by Ray, on as many nodes as the run needs.

Each process is still the same `tether launch ROLE` process. A small actor, ``ProcessHost``, asks
Ray for the process's resources (``placement.ray``: CPUs, GPUs, a preferred node) and starts the
process on the node it lands on; `tether run`'s watch loop (``launch.runner``) drives the hosts
through ``RayProcess`` as it drives local processes, so restarts, the end of a run and Ctrl-C
behave as they do on one host. What the processes need of each other follows from where Ray
placed them, never typed:

- the buffer's address and the learner's weight server are TCP endpoints on their nodes, and
  CURVE is on with keys made for the run (each bound to its process's role); a rollout on the
  learner's node reads weights through shared memory, one on another node over TCP. When every
  process lands on one node, the run is the local one: ipc sockets, shared memory, no keys;
- a learner of ``learner.nodes`` nodes is one placement group of a bundle per node, so its
  rendezvous (node rank 0's address and a free port there) is found, not typed;
- ``run_dir``: a node that sees the driver's writes there (a shared filesystem) runs its processes
  in it; on one that does not, a process runs in a directory of that node, and its host reads its
  metrics and logs back to the driver's ``run_dir`` at each poll, so ``tether status``, ``plot``
  and ``profile`` work from the head as they do locally. Checkpoints stay with the learner: where
  its node does not share ``run_dir``, tether says so at start.

A host that dies takes its process with it (the process gets SIGKILL when its parent does), and a
host that does not answer within ``POLL_DEADLINE_S`` is taken for lost with its node: the process
counts as exited with code 1, so a rollout or scorer is started again (on another node when its
own is gone) and a lost learner or buffer ends the run, for `tether run --resume`.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from common.config import ConfigError, TetherConfig
from launch.processes import DIST_ENV_KEYS, RoleProcess, Stopped, role_command, role_name

POLL_DEADLINE_S = 30.0  # a host that answers no poll this long is lost with its node
PLACEMENT_DEADLINE_S = 300.0  # the cluster has this long to find room for every process
PLACEMENT_PROGRESS_S = 15  # a line while waiting for room, this often
PLACEMENT_FIRST_NOTE_S = 5  # the first of them: placing takes a second or two where there is room
MARKER = ".tether-run"  # the driver writes the run's id here: a node that reads it back shares run_dir
SHIPPED = ("metrics", "logs")  # what a process on a node without run_dir sends back


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when its parent, the host actor, dies (a node lost, an actor
    killed), so nothing of the run outlives its host. Linux's PR_SET_PDEATHSIG."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


class ProcessHost:
    """One tether process on the node Ray placed this actor on: started, polled, signalled; where the
    node does not see ``run_dir``, the process runs in a directory of the node and the lines it
    adds to its own metrics and logs are read back with each poll."""

    def __init__(self, run_dir: str, run_id: str, share: str, name: str) -> None:
        try:
            with open(os.path.join(run_dir, MARKER)) as file:
                sees = file.read() == run_id
        except OSError:
            sees = False
        sees = share == "yes" or (share == "auto" and sees)
        self.run_dir = run_dir if sees else os.path.join(tempfile.gettempdir(), f"tether-{run_id}")
        self.shipping, self.name = not sees, name
        for directory in SHIPPED:
            os.makedirs(os.path.join(self.run_dir, directory), exist_ok=True)
        self.popen: subprocess.Popen | None = None
        self.offsets: dict[str, int] = {}

    def where(self) -> dict:
        import ray

        return {"node": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "run_dir": self.run_dir, "shipping": self.shipping}

    def free_port(self) -> int:
        from protocol.transport import free_port

        return free_port()

    def write(self, files: dict[str, bytes]) -> None:
        """Files under this node's run_dir (the config, the process's keys); private to its user.
        Each lands whole (written aside, then renamed): where nodes share run_dir, a process already
        started reads the same key file another process's host is writing again."""
        for relative, content in files.items():
            path = os.path.join(self.run_dir, relative)
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            aside = f"{path}.{os.getpid()}.part"
            with open(os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as file:
                file.write(content)
            os.replace(aside, path)

    def start(self, command: list[str], environment: dict[str, str], cwd: str) -> int:
        env = {key: value for key, value in os.environ.items() if key not in DIST_ENV_KEYS}
        env.update(environment)
        with open(os.path.join(self.run_dir, "logs", f"{self.name}.log"), "ab") as log:
            self.popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          cwd=cwd if os.path.isdir(cwd) else self.run_dir,
                                          preexec_fn=_die_with_parent, start_new_session=True)
        return self.popen.pid

    def poll(self) -> tuple[int | None, dict[str, tuple[str, bytes]]]:
        """The process's exit code (None: running) and, when shipping, what its files gained:
        ``{path under run_dir: ("append" | "replace", bytes)}``."""
        return self.popen.poll(), self._shipment() if self.shipping else {}

    def _shipment(self) -> dict[str, tuple[str, bytes]]:
        """The process's own files: its log, its metrics (``NAME*.jsonl``, the buffer's accounting),
        its lines of the node's start-up timeline."""
        out = {}
        for directory in SHIPPED:
            for entry in os.scandir(os.path.join(self.run_dir, directory)):
                mine = entry.name.startswith(self.name) or entry.name == "startup.jsonl"
                if not mine or not entry.is_file():
                    continue
                relative = f"{directory}/{entry.name}"
                if not entry.name.endswith((".jsonl", ".log")):  # rewritten whole (buffer_accounting.json)
                    stamp = entry.stat().st_mtime_ns
                    if self.offsets.get(relative) != stamp:
                        self.offsets[relative] = stamp
                        with open(entry.path, "rb") as file:
                            out[relative] = ("replace", file.read())
                    continue
                with open(entry.path, "rb") as file:
                    file.seek(self.offsets.get(relative, 0))
                    added = file.read()
                cut = added.rfind(b"\n") + 1  # whole lines only; the rest comes with the next poll
                self.offsets[relative] = self.offsets.get(relative, 0) + cut
                added = added[:cut]
                if entry.name == "startup.jsonl":  # the node's timeline: this process's phases alone
                    added = b"".join(line for line in added.splitlines(keepends=True)
                                     if json.loads(line).get("role", "").startswith(self.name))
                if added:
                    out[relative] = ("append", added)
        return out

    def signal(self, number: int) -> None:
        try:
            os.killpg(self.popen.pid, number)
        except ProcessLookupError:
            pass

    def group_alive(self) -> bool:
        try:
            os.killpg(self.popen.pid, 0)
            return True
        except ProcessLookupError:
            return False


def cpus_that_fit(config: TetherConfig, cluster_cpus: float, grows: bool) -> dict[str, float]:
    """CPUs per process of each role: ``placement.ray.cpus`` where it says, else 1, or, where the
    cluster has fewer CPUs than that asks in all, an equal share of what the roles set leave (a
    2-CPU machine runs the demo's four processes at 0.5 each). What the set ones ask alone is
    refused at once where it cannot fit, unless the cluster may grow (one tether joined, which an
    autoscaler may extend): then a warning, and the placement waits."""
    learner = config.learner
    counts = {"buffer": 1, "learner": learner.ranks * learner.nodes, "rollout": config.rollout.engines,
              "scorer": config.scorer.workers}
    asked = config.placement.ray.cpus
    explicit = sum(asked[role] * count for role, count in counts.items() if role in asked)
    unset = sum(count for role, count in counts.items() if role not in asked)
    if explicit + unset <= cluster_cpus:
        return {role: asked.get(role, 1.0) for role in counts}
    if explicit + (0.01 * unset) > cluster_cpus:
        message = (f"placement.ray.cpus: the run's processes ask {explicit:g} CPUs "
                   f"({', '.join(f'{role} {asked[role]:g} x {counts[role]}' for role in counts if role in asked)})"
                   f"{f' and {unset} more processes at least a share' if unset else ''}; the cluster has "
                   f"{cluster_cpus:g}. Lower placement.ray.cpus (fractions work: 0.5)")
        if not grows:
            raise ConfigError(message)
        print(f"tether run: warning: {message}, or let the cluster grow; waiting for room", file=sys.stderr,
              flush=True)
        return {role: asked.get(role, 1.0) for role in counts}
    share = math.floor((cluster_cpus - explicit) / unset * 1000) / 1000
    print(f"tether run: the cluster has {cluster_cpus:g} CPUs for {explicit + unset:g} asked: each process whose "
          f"role placement.ray.cpus leaves unset gets {share:g}", file=sys.stderr, flush=True)
    return {role: asked.get(role, share) for role in counts}


def _resources(resources: dict) -> str:
    """Ray's resources as a reader wants them: CPUs, GPUs and memory first, none of Ray's own
    per-node markers."""
    shown = {key: value for key, value in resources.items() if not key.startswith(("node:", "accelerator_type"))}
    for key in ("memory", "object_store_memory"):
        if key in shown:
            shown[key] = f"{shown[key] / 2 ** 30:.1f} GiB"
    return "{" + ", ".join(f"{key}: {value:g}" if isinstance(value, float) else f"{key}: {value}"
                           for key, value in sorted(shown.items(), key=lambda item: (item[0] not in ("CPU", "GPU"),
                                                                                      item[0]))) + "}"


def _own_session_dir() -> str | None:
    """Ray's session directory where this process started the cluster itself (its logs, sockets,
    runtime resources); None where it joined one that others run."""
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    if node is None or not node.head:
        return None
    return node.get_session_dir_path()


def _client_key(name: str) -> str:
    """A process's CURVE key name, bound to its role (protocol.security.role_of_key): ``rollout-0``
    for ``rollout0``; the learner's and the buffer's are their role's."""
    role = name.rstrip("0123456789")
    return role if role == name else f"{role}-{name[len(role):]}"


def _lost(error: Exception) -> bool:
    """Whether a failed call to a host means the host (or its node) is gone."""
    import ray.exceptions

    return isinstance(error, (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
                              ray.exceptions.RaySystemError))


class RayProcess:
    """A role's process on the nodes Ray placed it on (a learner of several nodes: one per node),
    seen as `tether run` sees a local one: ``poll``, ``wait``, ``signal``, ``group_alive``. What
    the hosts read back of a node that does not share run_dir lands in the driver's ``run_dir``."""

    def __init__(self, name: str, hosts: list, pids: list[int], run_dir: str) -> None:
        self.name, self.hosts, self.run_dir = name, hosts, run_dir
        self.pid = pids[0]
        self.code: int | None = None

    def poll(self) -> int | None:
        if self.code is not None:
            return self.code
        import ray

        try:
            answers = ray.get([host.poll.remote() for host in self.hosts], timeout=POLL_DEADLINE_S)
        except Exception as error:
            if not _lost(error):
                raise
            print(f"tether run: {self.name}'s node is lost ({type(error).__name__}); it counts as exited with "
                  "code 1", file=sys.stderr, flush=True)
            self.code = 1
            return self.code
        codes = []
        for code, files in answers:
            codes.append(code)
            for relative, (mode, content) in files.items():
                with open(os.path.join(self.run_dir, relative), "ab" if mode == "append" else "wb") as file:
                    file.write(content)
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            self.code = failed[0]
        elif all(code == 0 for code in codes):
            self.code = 0
        return self.code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.name, timeout)
            time.sleep(0.2)
        return self.code

    def _each(self, method: str, *arguments):
        import ray

        answers = []
        for host in self.hosts:
            try:
                answers.append(ray.get(getattr(host, method).remote(*arguments), timeout=POLL_DEADLINE_S))
            except Exception as error:
                if not _lost(error):
                    raise
        return answers

    def signal(self, number: int) -> None:
        self._each("signal", number)

    def group_alive(self) -> bool:
        return any(self._each("group_alive"))


class RayPlacement:
    """Every process of a run placed on a Ray cluster: ``start_role`` is ``launch.runner.start_role``
    for `tether run --ray`. Hosts are placed before any process starts, since the endpoints follow
    from where they land; a restart places a fresh host (on another node when the old one's is gone)."""

    def __init__(self, config: TetherConfig, config_path: str, address: str, stop=lambda: None) -> None:
        """``stop()``: the number of a signal that asked the run to stop while it is placed, or None."""
        self.stop = stop
        alone = not address and not os.environ.get("RAY_ADDRESS")
        if alone:  # a cluster of this machine alone: on loopback (Ray reads this when imported), as nothing joins it
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        try:
            import ray
        except ImportError:
            raise ConfigError("tether run --ray needs Ray: pip install 'tether[ray]'") from None
        self.ray, self.config, self.config_path = ray, config, config_path
        self.started_ray = not ray.is_initialized()
        self.session_dir: str | None = None  # Ray's logs of a cluster tether started itself
        if self.started_ray:
            ray.init(address=address or None, namespace="tether", log_to_driver=False,
                     **({"include_dashboard": False} if alone else {}))
            self.session_dir = _own_session_dir()
        self.run_id = uuid.uuid4().hex
        with open(os.path.join(config.run_dir, MARKER), "w") as file:
            file.write(self.run_id)
        self.gpus = ray.cluster_resources().get("GPU", 0) > 0
        self.remote_host = ray.remote(ProcessHost)
        self.learner_group = None
        self.keys: str | None = None  # the run's CURVE keys, made once the processes span several nodes
        self.master_port: int | None = None
        self.hosts: dict[str, list] = {}  # process name -> its hosts now (a learner: one per node)
        self.where: dict[str, list[dict]] = {}
        self.started: set[str] = set()  # names whose hosts ran a process: a start of one places anew
        names = ["buffer", "learner", *(role_name("rollout", i) for i in range(config.rollout.engines)),
                 *(role_name("scorer", i) for i in range(config.scorer.workers))]
        try:
            self.cpus = cpus_that_fit(config, ray.cluster_resources().get("CPU", 0.0), grows=self.session_dir is None)
            for name in names:
                self.hosts[name] = self._place(name)
            self.where = self._locate(names)
        except BaseException:  # a refusal, the deadline, or Ctrl-C while waiting: nothing of the run stays
            self.close()
            raise
        self.nodes = {info["node"] for infos in self.where.values() for info in infos}
        self.keys = tempfile.mkdtemp(prefix="tether-keys-") if len(self.nodes) > 1 else None
        self.endpoints = self._endpoints() if self.keys else {}
        learner = self.where["learner"][0]
        if learner["shipping"]:
            print(f"tether run: the learner's node does not see {config.run_dir}: its checkpoints stay in "
                  f"{learner['run_dir']}/checkpoints on node {learner['node']}; for --resume from the head, make "
                  "run_dir a filesystem every node shares", file=sys.stderr, flush=True)
        print(f"tether run: placed by Ray on {len(self.nodes)} node(s): "
              + ", ".join(f"{name} on {' and '.join(info['node'][:8] for info in infos)}"
                          for name, infos in self.where.items()), flush=True)

    # ---------------------------------------------------------------- placement

    def _options(self, role: str, processes: int = 1) -> dict:
        """Ray's options for a host of ``role``: its resources, and its preferred node (soft: where
        that node is gone, any node with room)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ray_cfg, rollout = self.config.placement.ray, self.config.rollout
        default_gpus = {"rollout": rollout.tensor_parallel_size, "scorer": 1, "learner": 1}.get(role, 0)
        options = {"num_cpus": self.cpus[role] * processes,
                   "num_gpus": ray_cfg.gpus.get(role, default_gpus if self.gpus else 0) * processes,
                   "max_restarts": 0}
        preferred = ray_cfg.nodes.get(role)
        if preferred is not None:
            nodes = [node["NodeID"] for node in self.ray.nodes() if node["Alive"] and preferred in node["Resources"]]
            if nodes:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(nodes[0], soft=True)
        return options

    def _place(self, name: str) -> list:
        role = name.rstrip("0123456789")
        share = self.config.placement.ray.share_run_dir
        learner = self.config.learner
        if role == "learner" and learner.nodes > 1:  # one bundle a node: the ranks' rendezvous is found
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options = self._options(role, learner.ranks)
            bundle = {"CPU": options["num_cpus"], **({"GPU": options["num_gpus"]} if options["num_gpus"] else {})}
            self.learner_group = placement_group([bundle] * learner.nodes, strategy="STRICT_SPREAD")
            return [self.remote_host.options(num_cpus=options["num_cpus"], num_gpus=options["num_gpus"], max_restarts=0,
                                             scheduling_strategy=PlacementGroupSchedulingStrategy(self.learner_group, i))
                    .remote(self.config.run_dir, self.run_id, share, name) for i in range(learner.nodes)]
        processes = learner.ranks if role == "learner" else 1
        return [self.remote_host.options(**self._options(role, processes)).remote(self.config.run_dir, self.run_id,
                                                                                  share, name)]

    def _locate(self, names: list[str]) -> dict[str, list[dict]]:
        """Where each host landed, once Ray found room for all of them: waited for a second at a
        time (a signal stops the wait), with a line of progress after ``PLACEMENT_FIRST_NOTE_S``, then
        every ``PLACEMENT_PROGRESS_S``."""
        calls = {name: [host.where.remote() for host in self.hosts[name]] for name in names}
        refs = [ref for name_refs in calls.values() for ref in name_refs]
        started = time.monotonic()
        note_at = started + PLACEMENT_FIRST_NOTE_S
        while True:
            _, pending = self.ray.wait(refs, num_returns=len(refs), timeout=1.0)
            if self.stop() is not None:
                raise Stopped(self.stop())
            if not pending:
                return {name: self.ray.get(name_refs, timeout=POLL_DEADLINE_S) for name, name_refs in calls.items()}
            waited = time.monotonic() - started
            waiting = [name for name, name_refs in calls.items() if set(name_refs) & set(pending)]
            asks = ", ".join(f"{name} {self._asks(name)}" for name in waiting)
            if waited > PLACEMENT_DEADLINE_S:
                raise ConfigError(
                    f"placement.ray: the cluster found no room within {PLACEMENT_DEADLINE_S:.0f}s for {asks}; it "
                    f"has {_resources(self.ray.cluster_resources())} in all, {_resources(self.ray.available_resources())} "
                    "free. Lower placement.ray.cpus or placement.ray.gpus (fractions work), or add nodes")
            if time.monotonic() >= note_at:
                note_at += PLACEMENT_PROGRESS_S
                print(f"tether run: waiting {waited:.0f}s of {PLACEMENT_DEADLINE_S:.0f}s for Ray to place {asks} "
                      f"(free: {_resources(self.ray.available_resources())})", file=sys.stderr, flush=True)

    def _asks(self, name: str) -> str:
        role = name.rstrip("0123456789")
        options = self._options(role, self.config.learner.ranks if role == "learner" else 1)
        return f"({options['num_cpus']:g} CPU" + (f", {options['num_gpus']:g} GPU)" if options["num_gpus"] else ")")

    def _endpoints(self) -> dict[str, str]:
        """Across nodes: TCP on the nodes the buffer and the learner landed on, CURVE on."""
        buffer, learner = self.hosts["buffer"][0], self.hosts["learner"][0]
        buffer_ip, learner_ip = self.where["buffer"][0]["ip"], self.where["learner"][0]["ip"]
        ports = self.ray.get([buffer.free_port.remote(), learner.free_port.remote()], timeout=POLL_DEADLINE_S)
        return {"transport.buffer_address": f"tcp://{buffer_ip}:{ports[0]}",
                "transport.weights_address": f"tcp://{learner_ip}:{ports[1]}"}

    def _key_files(self, name: str, run_dir: str) -> tuple[dict[str, bytes], dict[str, str]]:
        """The CURVE files a process needs under its run_dir's ``keys/`` and the overrides naming them.
        Client keys are named for the process's role (``rollout-0``): the buffer admits a key only
        as the role it names."""
        from protocol.security import make_keys

        role, client = name.rstrip("0123456789"), _client_key(name)
        if not os.path.exists(os.path.join(self.keys, "server.key")):
            make_keys(self.keys, "server")
            os.makedirs(os.path.join(self.keys, "allowed"), exist_ok=True)
            for other in self.hosts:
                public, _ = make_keys(self.keys, _client_key(other))
                shutil.copy(public, os.path.join(self.keys, "allowed"))
        wanted = ["server.key", f"{client}.key", f"{client}.key_secret"]
        if role in ("buffer", "learner"):  # the servers: the buffer, and the learner's weight server
            wanted += ["server.key_secret", *(f"allowed/{key}" for key in os.listdir(os.path.join(self.keys, "allowed")))]
        files = {}
        for relative in wanted:
            with open(os.path.join(self.keys, relative), "rb") as file:
                files[f"keys/{relative}"] = file.read()
        keys = os.path.join(run_dir, "keys")
        return files, {"transport.curve.enabled": "true", "transport.curve.server_key": f"{keys}/server.key_secret",
                       "transport.curve.server_public_key": f"{keys}/server.key",
                       "transport.curve.client_key": f"{keys}/{client}.key_secret",
                       "transport.curve.allowed_clients": f"{keys}/allowed"}

    # ---------------------------------------------------------------- processes

    def start_role(self, config: TetherConfig, role: str, config_path: str, worker_index: int = 0) -> RoleProcess:
        """Worker ``worker_index`` of ``role`` on its host; a host that ran it before is replaced by a
        fresh one, which Ray may put on another node."""
        name = role_name(role, worker_index)
        if name in self.started:  # a restart: the old hosts go, fresh ones are placed
            for host in self.hosts[name]:
                self.ray.kill(host)
            self.hosts[name] = self._place(name)
            self.where[name] = self._locate([name])[name]
        self.started.add(name)
        hosts = self.hosts[name]
        pids = []
        for node_rank, (host, where) in enumerate(zip(hosts, self.where[name])):
            overrides, files = self._overrides(name, where)
            if where["shipping"]:
                with open(config_path) as file:
                    files["config.yaml"] = file.read().encode()
                overrides["run_dir"] = where["run_dir"]
            self.ray.get(host.write.remote(files), timeout=POLL_DEADLINE_S)
            local_config = os.path.join(where["run_dir"], "config.yaml") if where["shipping"] else config_path
            command = role_command(role, local_config, worker_index)
            command += [item for key, value in overrides.items() for item in ("-o", f"{key}={value}")]
            if role == "learner" and len(hosts) > 1:
                master = self.where[name][0]
                command += ["--nnodes", str(len(hosts)), "--node-rank", str(node_rank), "--master-addr", master["ip"],
                            "--master-port", str(self._learner_port(hosts[0]))]
            # the user's modules (reward functions, tools, environments) where tether was started:
            # found on every node that has that directory (a shared filesystem), as locally
            environment = {"PYTHONUNBUFFERED": "1", "TETHER_NODE": where["node"],
                           "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
                           "OMP_NUM_THREADS": str(max(1, int(self.cpus.get(role, 1.0))))}
            pids.append(self.ray.get(host.start.remote(command, environment, os.getcwd()), timeout=POLL_DEADLINE_S))
        log_path = os.path.join(config.run_dir, "logs", f"{name}.log")
        return RoleProcess(name, role, worker_index, RayProcess(name, hosts, pids, config.run_dir), log_path)

    def _learner_port(self, host) -> int:
        """torch.distributed's port on the learner's node rank 0, found once."""
        if self.master_port is None:
            self.master_port = self.ray.get(host.free_port.remote(), timeout=POLL_DEADLINE_S)
        return self.master_port

    def _overrides(self, name: str, where: dict) -> tuple[dict[str, str], dict[str, bytes]]:
        """The config a process of ``name`` on the host ``where`` runs with beyond the run's, and the
        files it needs there: endpoints and keys, and whether it reads weights through shared memory
        (on the learner's node) or over TCP."""
        if not self.keys:
            return {}, {}
        files, curve = self._key_files(name, where["run_dir"])
        overrides = {**self.endpoints, **curve}
        if name.startswith("rollout"):
            same_node = where["node"] == self.where["learner"][0]["node"]
            overrides["transport.weight_transport"] = "shm" if same_node else "tcp"
        elif name == "learner":  # serves other nodes' engines too: one restarted elsewhere may need it
            overrides["transport.weight_transport"] = "tcp"
        return overrides, files

    def close(self) -> None:
        """After `tether run` stopped every process: the hosts go (and with them anything left)."""
        for hosts in self.hosts.values():
            for host in hosts:
                self.ray.kill(host)
        if self.learner_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.learner_group)
        if self.keys:
            shutil.rmtree(self.keys, ignore_errors=True)
        if self.started_ray:
            self.ray.shutdown()
        if self.session_dir is not None:  # Ray's session of a cluster tether started: its logs go with it
            shutil.rmtree(self.session_dir, ignore_errors=True)
