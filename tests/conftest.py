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
