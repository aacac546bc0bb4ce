"""One config, validated at start; errors name the key."""

import re

import pytest
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from common.config import ConfigError, load_config
from common.model_dirs import resolve_models
from launch.cli import app
from launch.exit_codes import ExitCode

MINIMAL = {"models": {"policy": "/p", "reward": "/r"}, "data": {"prompts": "/d.jsonl"}}


def write(tmp_path, data, name="config.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_defaults_and_overrides(tmp_path):
    config = load_config(write(tmp_path, MINIMAL), ["learner.batch_size=32", "buffer.max_staleness=0",
                                                    "placement.cores.rollout=[0]", "learner.dual_clip=null"])
    assert config.learner.batch_size == 32 and config.buffer.max_staleness == 0
    assert config.placement.cores == {"rollout": [0]}
    assert config.learner.dual_clip is None and config.learner.clip_eps == 0.2
    assert config.reference_path == "/p"  # the reference defaults to the SFT policy


def test_toml_is_read_too(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('[models]\npolicy = "/p"\nreward = "/r"\n[data]\nprompts = "/d"\n[learner]\nppo_epochs = 3\n')
    assert load_config(path).learner.ppo_epochs == 3


@pytest.mark.parametrize("overrides, message", [
    (["learner.batch_sise=3"], "learner.batch_sise: unknown key"),
    (["learner.clip_eps=-1"], "learner.clip_eps: Input should be greater than 0"),
    (["buffer.max_staleness=soon"], "buffer.max_staleness: Input should be a valid integer"),
    (["learner.batch_size=30"], "must be a multiple of learner.minibatch_size"),
    (["placement.cores.critic=[1]"], "unknown role 'critic'"),
    (["learner"], "must look like key.subkey=value"),
    (["learner.max_tokens_per_microbatch=100", "rollout.max_model_len=128"],
     "learner.max_tokens_per_microbatch \\(100\\) is less than rollout.max_model_len"),
    (["learner.policy_loss=cispo", "learner.ratio_level=sequence"], "learner.policy_loss cispo weighs each token"),
    (["learner.behavior_weight_floor=0.5"], "learner.behavior_weight_floor \\(0.5\\) bounds the weights"),
    (["learner.behavior_correction=mask", "learner.behavior_weight_floor=3"], "a floor under behavior_weight_cap"),
    (["scorer.overlong_buffer=40"], "scorer.overlong_buffer \\(40\\) must be under the length it counts to"),
    (["buffer.filter_groups=true", "rollout.samples_per_prompt=2"], "compares no groups \\(use grpo or rloo\\)"),
    (["buffer.filter_groups=true", "rollout.samples_per_prompt=4", "learner.advantage_estimator=grpo",
      "buffer.max_filter_ratio=0.01"], "no group could ever be filtered"),
    (["learner.behavior_correction=mask", "learner.behavior_weight_cap=null"], "needs learner.behavior_weight_cap"),
    (["learner.behavior_correction_level=sequence", "learner.behavior_weight_cap=null"],
     "a sequence's product of weights has no bound"),
])
def test_bad_values_name_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(write(tmp_path, MINIMAL), overrides)


@pytest.mark.parametrize("old, new", [("rollout.temperature=0.7", "sampling.temperature"),
                                      ("rollout.top_p=0.9", "sampling.top_p"), ("rollout.top_k=8", "sampling.top_k"),
                                      ("learner.dtype=bfloat16", "models.dtype"),
                                      ("placement.turn_deadline_s=60", "placement.shift_deadline_s")])
def test_a_key_that_moved_names_its_new_home(tmp_path, old, new):
    with pytest.raises(ConfigError, match=f"{old.split('=')[0]}: moved to {new}"):
        load_config(write(tmp_path, MINIMAL), [old])
    assert load_config(write(tmp_path, MINIMAL), [new + "=" + old.split("=")[1]])  # where it is read now


def test_one_sampling_value_for_every_role(tmp_path):
    config = load_config(write(tmp_path, MINIMAL), ["sampling.temperature=0.7", "sampling.top_p=0.9",
                                                    "sampling.top_k=8"])
    reference = config.sampling.without_truncation()
    assert (reference.temperature, reference.top_p, reference.top_k) == (0.7, 1.0, 0)
    with pytest.raises(ValidationError):  # one value: nobody changes it under another role
        config.sampling.top_p = 0.5


def test_missing_section_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="models: missing"):
        load_config(write(tmp_path, {"data": {"prompts": "/d"}}))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_missing_model_path_names_the_key(tmp_path):
    config = load_config(write(tmp_path, MINIMAL))
    with pytest.raises(ConfigError, match="models.policy: /p does not exist"):
        resolve_models(config, "rollout")
    with pytest.raises(ConfigError, match=r"models.policy: /p does not exist"):
        resolve_models(config, "scorer")
    config = load_config(write(tmp_path, MINIMAL), [f"models.policy={tmp_path}", f"models.reference={tmp_path}"])
    with pytest.raises(ConfigError, match="models.reward: /r does not exist"):
        resolve_models(config, "scorer")


def test_a_hub_id_resolves_from_the_local_cache_and_an_unknown_one_names_the_key(tmp_path, monkeypatch):
    """No hub here: an id is found in the Hugging Face cache (as a download would leave it), and
    one that is nowhere is refused naming the config key."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--tether-tests--tiny" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"max_position_embeddings": 64}')
    (snapshot / "model.safetensors").write_bytes(b"")
    (cache / "models--tether-tests--tiny" / "refs").mkdir()
    (cache / "models--tether-tests--tiny" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    config = load_config(write(tmp_path, MINIMAL), ["models.policy=tether-tests/tiny", f"data.prompts={prompts}"])
    assert resolve_models(config, "rollout").models.policy == str(snapshot)

    config = load_config(write(tmp_path, MINIMAL), ["models.policy=tether-tests/absent", f"data.prompts={prompts}"])
    with pytest.raises(ConfigError, match="models.policy: 'tether-tests/absent' is not a directory, and as a "
                                          "Hugging Face hub id it cannot be had here"):
        resolve_models(config, "rollout")


def test_cli_config_show_prints_the_resolved_config(tmp_path):
    result = CliRunner().invoke(app, ["config", "show", "-c", str(write(tmp_path, MINIMAL)),
                                      "-o", "learner.kl_coef=0.1"])
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.output)
    assert shown["learner"]["kl_coef"] == 0.1 and shown["buffer"]["max_staleness"] == 1


def test_config_show_explains_every_key_and_loads_back_the_same(tmp_path):
    from common.config import describe_config

    config = load_config(write(tmp_path, MINIMAL), ["placement.cores.rollout=[0, 1]", "sampling.top_p=0.9",
                                                    'scorer.reward_functions=[{function: "m:f", weight: 0.5}]'])
    shown = describe_config(config)
    assert all(" # " in line and not line.rstrip().endswith("# None") for line in shown.splitlines())
    assert "  top_p: 0.9  # nucleus sampling" in shown
    path = tmp_path / "shown.yaml"
    path.write_text(shown)
    assert load_config(path) == config


def test_cli_refuses_an_unknown_key_and_a_missing_model(tmp_path):
    result = CliRunner().invoke(app, ["run", "-c", str(write(tmp_path, MINIMAL)), "-o", "rollout.temprature=1"])
    assert result.exit_code == ExitCode.CONFIG_ERROR and "rollout.temprature: unknown key" in result.output
    result = CliRunner().invoke(app, ["run", "-c", str(write(tmp_path, MINIMAL))])
    assert result.exit_code == ExitCode.CONFIG_ERROR and "models.policy: /p does not exist" in result.output


def test_an_engine_binds_its_tensor_parallel_workers_to_its_cores():
    from common.engines import omp_threads_bind

    assert omp_threads_bind([0, 1], 1) == "0,1"
    assert omp_threads_bind([0, 1], 2) == "0|1"
    assert omp_threads_bind([2, 3, 4, 5], 2) == "2,3|4,5"
    assert omp_threads_bind([0], 2) == "0|0"  # fewer cores than workers: they take turns


def test_a_role_s_devices_are_split_between_its_processes():
    from common.config import load_config

    config = load_config(None, ["rollout.engines=2", "scorer.workers=3", "placement.cores.rollout=[0, 1, 2, 3]",
                                "placement.cores.scorer=[4]", "placement.cuda_visible_devices.rollout='0,1'",
                                "learner.ranks=2", "learner.minibatch_size=8", "placement.cuda_visible_devices.learner='2,3'"],
                         base={"models": {"policy": "p", "reward": "r"}, "data": {"prompts": "d"}})
    assert config.cores_of("rollout", 0) == [0, 1] and config.cores_of("rollout", 1) == [2, 3]
    assert config.cores_of("scorer", 2) == [4]  # fewer devices than processes: shared
    assert config.cuda_devices_of("rollout", 1) == "1"
    assert config.cuda_devices_of("learner", 0) == "2,3"  # the ranks pick theirs by LOCAL_RANK
    assert config.cuda_devices_of("scorer", 0) is None


def test_colocated_every_role_has_every_device_named_and_waits_passively():
    from common.config import load_config
    from launch.runner import _role_env

    config = load_config(None, ["placement.mode=colocate", "placement.cores.buffer=[0]", "placement.cores.rollout=[0]",
                                "placement.cores.scorer=[1]", "placement.cores.learner=[1]", "rollout.engines=2",
                                "placement.cuda_visible_devices.rollout='0'",
                                "placement.cuda_visible_devices.learner='1'"],
                         base={"models": {"policy": "p", "reward": "r"}, "data": {"prompts": "d"}})
    assert [config.cores_of(role) for role in ("rollout", "scorer", "learner")] == [[0], [0, 1], [0, 1]]
    assert config.cores_of("rollout", 1) == [1]  # the pool's engines split them, as split does
    assert config.cores_of("buffer") == [0]  # the buffer takes no turns: it answers them
    assert config.cuda_devices_of("scorer") == "0,1" and config.cuda_devices_of("learner") == "0,1"
    env = _role_env(config, "learner", 0)
    assert (env["OMP_WAIT_POLICY"], env["GOMP_SPINCOUNT"], env["OMP_NUM_THREADS"]) == ("PASSIVE", "10000", "2")
    split = load_config(None, ["placement.cores.learner=[1]"],
                        base={"models": {"policy": "p", "reward": "r"}, "data": {"prompts": "d"}})
    assert split.cores_of("learner") == [1] and "OMP_WAIT_POLICY" not in _role_env(split, "learner", 0)


def test_the_minibatch_must_split_evenly_between_learner_ranks():
    import pytest

    from common.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="minibatch_size \\(6\\) must be a multiple of learner.ranks \\(4\\)"):
        load_config(None, ["learner.ranks=4", "learner.minibatch_size=6", "learner.batch_size=12"],
                    base={"models": {"policy": "p", "reward": "r"}, "data": {"prompts": "d"}})


@pytest.mark.parametrize("overrides, message", [
    (["models.reward=null"], "nothing to train on: set models.reward, scorer.reward_functions, scorer.judges, scorer.reward_url, models.teacher, rollout.environment"),
    (["models.reward=null", "models.critic_init=reward", "scorer.reward_functions=[{function: 'a:b'}]"],
     "models.critic_init is reward but there is no models.reward"),
    (["scorer.reward_functions=[{function: 'a:b', wieght: 2}]"], r"scorer.reward_functions.0.wieght: unknown key"),
    (["eval.every=5"], "eval.every needs eval.prompts"),
    (["learner.ptx_coef=0.5"], "learner.ptx_coef > 0 and data.ptx go together"),
    (["learner.lora_rank=8", "learner.zero_stage=3"], "learner.lora_rank with learner.zero_stage 3"),
    (["learner.advantage_estimator=grpo"], "rollout.samples_per_prompt must be >= 2"),
    (["learner.distill_only=true"], "learner.distill_only: distillation needs models.teacher"),
    (["learner.distill_coef=0.5"], "learner.distill_coef: distillation needs models.teacher"),
    (["models.teacher=t", "learner.distill_coef=0"], "learner.distill_coef must be over 0 with models.teacher"),
    (["models.teacher=t", "sampling.top_p=0.9"], "models.teacher with sampling.top_p < 1 or sampling.top_k"),
    (["models.teacher=t", "buffer.filter_groups=true", "learner.advantage_estimator=grpo",
      "rollout.samples_per_prompt=2"], "buffer.filter_groups with models.teacher"),
    (["models.teacher=t", "learner.distill_only=true"],
     "learner.distill_only trains on the teacher alone: models.reward would be computed and never trained on"),
])
def test_what_is_trained_on_is_checked_at_load(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, MINIMAL), overrides)


def test_a_reward_function_that_cannot_be_imported_names_its_key():
    from scorer.rewards import RewardFunction

    with pytest.raises(ConfigError, match=r"scorer.reward_functions\[0\].function: cannot import 'nope:fn'"):
        RewardFunction.load("nope:fn", 1.0, "scorer.reward_functions[0].function")
    with pytest.raises(ConfigError, match=r"scorer.gold_reward: .*it asks for \['answer'\]"):
        RewardFunction.load("tests.test_config:_asks_for_answer", 1.0, "scorer.gold_reward")
    # a parameter with a default is the function's own business; only what it names is passed
    tolerant = RewardFunction.load("tests.test_config:_with_a_tolerance", 1.0, "scorer.reward_functions[0]")
    assert tolerant.arguments == ("response",)
    assert tolerant.call({"response": "51", "row": {}})() == 1.0


def _asks_for_answer(response, answer):
    return float(response == answer)


def _with_a_tolerance(response, tolerance=0.5):
    return float(abs(float(response) - 51) <= tolerance)


@pytest.mark.parametrize("name", ["demo.yaml", "own_model.yaml"])
def test_the_shipped_configs_show_on_their_own(name):
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", name)
    result = CliRunner().invoke(app, ["config", "show", "-c", path])
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.output)
    assert shown["models"]["policy"] and shown["data"]["prompts"]


EXTRA = {"eval.prompts": ["eval.every=5"], "data.ptx": ["learner.ptx_coef=0.1"]}  # what makes the key read


@pytest.mark.parametrize("key, file_text, message", [
    ("data.prompts", '{"prompt": "a"}\n\n{"prompt": "b"}\n{"promt": "c"}\n',
     'line 4 has no "prompt" and no "messages" (its keys: promt)'),
    ("eval.prompts", '{"messages": "hi"}\n', 'line 1 has "messages" "hi", not a list of messages'),
    ("data.ptx", '{"text": "a b"}\n{"txt": "c"}\n', 'line 2 has no "text"'),
    ("data.ptx", '{"text": "a b"}\n{"text": \n', "line 2 is not JSON"),
])
def test_tether_run_checks_its_data_before_any_process_starts(tmp_path, tiny_assets, key, file_text, message):
    """A bad row was found by the rollout seconds after `tether run` started four processes."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(file_text)
    overrides = [f"{key}={bad}", f"run_dir={tmp_path / 'run'}", *EXTRA.get(key, [])]
    config = {"models": {"policy": tiny_assets["policy"], "reward": tiny_assets["reward"]},
              "data": {"prompts": tiny_assets["prompts"]}}
    result = CliRunner().invoke(app, ["run", "-c", str(write(tmp_path, config)), *sum((["-o", o] for o in overrides), [])])
    assert result.exit_code == ExitCode.CONFIG_ERROR and f"{key}: {bad} {message}" in result.output, result.output
    assert not (tmp_path / "run").exists()  # no process started, nothing written


def test_tether_run_and_pipeline_check_user_functions_and_every_stage_s_rows_first(tmp_path, tiny_assets):
    config = {"models": {"policy": tiny_assets["policy"], "reward": tiny_assets["reward"]},
              "data": {"prompts": tiny_assets["prompts"]}, "run_dir": str(tmp_path / "run"),
              "scorer": {"reward_functions": [{"function": "tests.test_config:_no_such_function"}]}}
    result = CliRunner().invoke(app, ["run", "-c", str(write(tmp_path, config))])
    assert result.exit_code == ExitCode.CONFIG_ERROR and ("scorer.reward_functions[0].function: cannot import "
                                      "'tests.test_config:_no_such_function'") in result.output, result.output
    demonstrations, rankings = tmp_path / "sft.jsonl", tmp_path / "rm.jsonl"
    demonstrations.write_text('{"prompt": "a", "response": "b"}\n')
    rankings.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n')
    stages = {"sft": {"model": tiny_assets["policy"], "data": str(demonstrations)}, "rm": {"data": str(rankings)},
              "run_dir": str(tmp_path / "run")}
    result = CliRunner().invoke(app, ["pipeline", "-c", str(write(tmp_path, stages, "stages.yaml"))])
    assert result.exit_code == ExitCode.CONFIG_ERROR and f'rm.data: {rankings} line 2 has no "rejected" text' in result.output, result.output
    assert not (tmp_path / "run" / "sft").exists()  # found before SFT trained


def test_help_texts_flow_as_paragraphs_not_as_the_docstrings_lines():
    """A docstring's line ends are not the help's: "A learner of / several ranks" broke mid-sentence."""
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "A learner of several ranks (learner.ranks, or --nnodes) starts them" in result.output, result.output


def test_the_overlong_shaping_counts_an_episodes_every_turn(tmp_path):
    """rollout.max_new_tokens is a turn's limit: an episode's policy tokens are counted to it x max_turns."""
    single = load_config(write(tmp_path, MINIMAL), ["scorer.overlong_buffer=8"])
    assert single.overlong_max_length == 32
    episodes = load_config(write(tmp_path, MINIMAL), ["scorer.overlong_buffer=40",
                                                      "rollout.tools=[demos.agent:calculator]"])
    assert episodes.overlong_max_length == 4 * 32
    assert load_config(write(tmp_path, MINIMAL), ["scorer.overlong_buffer=8",
                                                  "scorer.overlong_max_length=20"]).overlong_max_length == 20


def test_a_verifiers_dataset_is_a_prompts_source_with_no_file(tmp_path):
    """data.prompts verifiers:<id> (its eval dataset: #eval) names an environment's dataset, which
    common.prompts.read_rows reads: no role refuses it for not being a file; a missing file still
    names the key (issue 52)."""
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text('{"max_position_embeddings": 64}')
    models = [f"models.policy={policy}", f"models.reward={policy}"]
    for source in ("verifiers:my_verifiers_env", "verifiers:my_verifiers_env#eval"):
        config = load_config(write(tmp_path, MINIMAL), [*models, f"data.prompts={source}"])
        for role in ("rollout", "scorer", "learner"):
            assert resolve_models(config, role).data.prompts == source
    config = load_config(write(tmp_path, MINIMAL), models)
    with pytest.raises(ConfigError, match="data.prompts: /d.jsonl does not exist"):
        resolve_models(config, "rollout")


GROUPS = ["rollout.samples_per_prompt=4"]


@pytest.mark.parametrize("overrides, message", [
    (["learner.loss_norm_length=512"], "learner.loss_norm_length (512) is the constant length of "
                                       "learner.loss_aggregation seq-mean-token-sum-norm; with token-mean"),
    (["learner.loss_norm_length=512", "learner.loss_aggregation=seq-mean-token-sum"], "with seq-mean-token-sum it"),
    (["scorer.overlong_penalty=0.5"], "scorer.overlong_penalty shape rewards only with scorer.overlong_buffer set"),
    (["scorer.overlong_max_length=64"], "scorer.overlong_max_length shape rewards only with scorer.overlong_buffer"),
    (["learner.grpo_std_normalize=false", "learner.advantage_estimator=rloo", *GROUPS],
     "learner.grpo_std_normalize false changes learner.advantage_estimator grpo's advantages; rloo divides by no"),
    (["learner.grpo_std_normalize=false"], "grpo's advantages; gae divides by no group's std"),
])
def test_a_key_that_does_nothing_in_its_mode_names_the_key_that_would_give_it_meaning(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(write(tmp_path, MINIMAL), overrides)


@pytest.mark.parametrize("overrides", [
    ["learner.loss_norm_length=512", "learner.loss_aggregation=seq-mean-token-sum-norm"],
    ["scorer.overlong_buffer=8", "scorer.overlong_penalty=0.5", "scorer.overlong_max_length=20"],
    ["learner.grpo_std_normalize=false", "learner.advantage_estimator=grpo", *GROUPS],
    # a key at its default is not set: a run's own config.yaml writes every key
    ["learner.grpo_std_normalize=true", "learner.advantage_estimator=rloo", "scorer.overlong_penalty=1.0", *GROUPS],
])
def test_those_keys_in_their_mode_or_at_their_default_are_taken(tmp_path, overrides):
    from common.config import dump_config

    config = load_config(write(tmp_path, MINIMAL), overrides)
    saved = tmp_path / "saved.yaml"
    saved.write_text(dump_config(config))  # as a run's config.yaml is written, every key in it
    assert load_config(saved, saved=True) == config
