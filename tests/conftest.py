import os

import pytest

# Tests run on few cores; keep each process's math on one thread unless a test asks for more.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """The demo's tokenizer, SFT policy and RM, built small and fast (real models, barely trained)."""
    from launch.demo import build_assets

    directory = tmp_path_factory.mktemp("assets")
    return build_assets(directory, sft_steps=60, rm_prompts=32, rm_epochs=1, log=lambda *_: None)


def base_config(tmp_path, assets, **sections):
    """A complete config dict for tests, pointing at the tiny assets and a private run dir."""
    config = {
        "run_dir": str(tmp_path / "run"),
        "models": {"policy": assets["policy"], "reward": assets["reward"]},
        "data": {"prompts": assets["prompts"]},
        "transport": {"connect_retries": 60, "connect_interval_s": 0.5},
    }
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    return config


def start_buffer(tmp_path, *overrides):
    """The real buffer role in a thread, on a config whose models it never loads. Returns the
    config, the dict that gets the role's result when it returns, and the thread to join."""
    import threading

    from buffer.main import run as run_buffer
    from common.config import load_config

    assets = {"policy": "/unused", "reward": "/unused", "prompts": "/unused"}
    config = load_config(None, ["learner.batch_size=2", "learner.minibatch_size=1", *overrides],
                         base=base_config(tmp_path, assets))
    result = {}
    thread = threading.Thread(target=lambda: result.update(run_buffer(config)), daemon=True)
    thread.start()
    return config, result, thread


def pytest_sessionfinish(session, exitstatus):
    """Engines the tests killed leave their queues in /dev/shm; a machine that runs the suite often
    would fill its RAM with them."""
    from launch.runner import remove_orphan_shared_memory

    removed = remove_orphan_shared_memory()
    if removed:
        print(f"\nremoved {len(removed)} shared-memory files that killed processes left in /dev/shm")
