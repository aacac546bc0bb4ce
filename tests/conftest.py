"""Every fixture of the suite; the helpers they call are in tests/helpers.py."""

import os
import shutil
import threading

import pytest

from tests.helpers import (CHAT_TEMPLATE_WITH_SYSTEM, policy_samples, start_buffer, train_data_parallel)

# Tests run on few cores; keep each process's math on one thread unless a test asks for more.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# the prompts of the learner's tests: each task twice, so a batch of 8 has every prompt twice
LEARNER_PROMPTS = ["even 1 2 3 :", "odd 4 4 4 :", "even 9 0 1 :", "odd 5 5 2 :"] * 2


def pytest_configure(config):
    config.addinivalue_line("markers", "buffer_overrides(*overrides): config overrides of the buffer_role fixture")


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """The demo's tokenizer, SFT policy and RM, built small and fast (real models, barely trained)."""
    from demos.parity import build_assets

    directory = tmp_path_factory.mktemp("assets")
    return build_assets(directory, sft_steps=60, rm_prompts=32, rm_epochs=1, log=lambda *_: None)


@pytest.fixture
def buffer_role(tmp_path, request):
    """The real buffer role in a thread (``start_buffer``), with the overrides a module or test names
    by ``@pytest.mark.buffer_overrides(...)``; yields (config, result, thread)."""
    marker = request.node.get_closest_marker("buffer_overrides")
    config, result, thread = start_buffer(tmp_path, *(marker.args if marker else ()))
    yield config, result, thread
    thread.join(timeout=40)


@pytest.fixture(scope="module")
def samples(tiny_assets):
    """On-policy samples of the SFT model, scored as the scorer would (reference = policy)."""
    return policy_samples(tiny_assets, LEARNER_PROMPTS)


@pytest.fixture
def restore_environment():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, tiny_assets):
    """Two PPO steps of the data-parallel driver on one rank (ZeRO-2), what 2 ranks are compared with."""
    return train_data_parallel(tmp_path_factory.mktemp("one"), tiny_assets, zero=2, ranks=1)


@pytest.fixture
def chat_policy(tmp_path, tiny_assets):
    """The demo policy with a chat template in its tokenizer."""
    from transformers import AutoTokenizer

    directory = tmp_path / "policy"
    shutil.copytree(tiny_assets["policy"], directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE_WITH_SYSTEM
    tokenizer.save_pretrained(directory)
    return str(directory), tokenizer


@pytest.fixture
def keys(tmp_path):
    """CURVE keys of a server and two clients, one of them allowed; returns ``curve(client)``, the
    transport.curve config of that client."""
    from common.config import CurveConfig
    from protocol.security import make_keys

    make_keys(str(tmp_path), "server")
    for name in ("allowed", "stranger"):
        make_keys(str(tmp_path), name)
    (tmp_path / "allowed_clients").mkdir()
    shutil.copy(tmp_path / "allowed.key", tmp_path / "allowed_clients")
    curve = lambda client: CurveConfig(
        enabled=True, server_key=str(tmp_path / "server.key_secret"), server_public_key=str(tmp_path / "server.key"),
        client_key=str(tmp_path / f"{client}.key_secret"), allowed_clients=str(tmp_path / "allowed_clients"))
    return curve


@pytest.fixture
def server(keys):
    """A CURVE server that welcomes whoever gets through; yields its address and the worker ids it heard."""
    from protocol.transport import BufferServer, free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    server = BufferServer(address, curve=keys("allowed"))
    heard = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            received = server.receive(timeout_ms=50)
            if received is not None:
                identity, message = received
                heard.append(message.fields["worker_id"])
                server.reply(identity, message.id, "welcome", {"run_id": "r", "incarnation": "i", "max_staleness": 1,
                                                               "batch_size": 1})

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield address, heard
    stop.set()
    thread.join()
    server.close()


@pytest.fixture
def served(tmp_path):
    """A weight writer and the weight server that serves its buckets over TCP."""
    from weight_sync.buckets import ShmWeightWriter
    from weight_sync.tcp import WeightServer

    writer = ShmWeightWriter(str(tmp_path / "learner"), bucket_bytes=16 * 1024)
    server = WeightServer(writer, "tcp://127.0.0.1:0")
    yield writer, server
    server.close()


@pytest.fixture
def stream(tmp_path):
    """A bucket-notice publisher and a prefetcher subscribed to it."""
    import time

    from weight_sync.stream import WeightPrefetcher, WeightStreamPublisher

    address = f"ipc://{tmp_path}/stream"
    publisher = WeightStreamPublisher(address)
    prefetcher = WeightPrefetcher(address, str(tmp_path))  # the tests write their versions under tmp_path
    time.sleep(0.3)  # let the subscription reach the publisher
    yield publisher, prefetcher
    prefetcher.close()
    publisher.close()


def pytest_sessionfinish(session, exitstatus):
    """Engines the tests killed leave their queues in /dev/shm; a machine that runs the suite often
    would fill its RAM with them."""
    from launch.runner import remove_orphan_shared_memory

    removed = remove_orphan_shared_memory()
    if removed:
        print(f"\nremoved {len(removed)} shared-memory files that killed processes left in /dev/shm")
