"""The agent demo's task (demos/agent.py) end to end: `tether run` on episodes with the
calculator tool, real vLLM, DeepSpeed and ZeroMQ."""

import json
import os
import random

import pytest
import yaml

from common.runlog import read_metrics
from tests.helpers import LOGPROB_TOLERANCE, REPO, run_to_the_end

STEPS = 4


@pytest.fixture(scope="module")
def agent_assets(tmp_path_factory):
    """The agent demo's policy, trained briefly: it already calls the tool now and then."""
    from demos.agent import build_assets

    return build_assets(tmp_path_factory.mktemp("agent"), sft_steps=300, log=lambda *_: None)


def agent_config(tmp_path, assets, **sections) -> dict:
    """configs/demo-agent.yaml on the built assets, small, with ``sections`` merged in."""
    with open(os.path.join(REPO, "configs", "demo-agent.yaml")) as file:
        config = yaml.safe_load(file)
    config.update(run_dir=str(tmp_path / "run"))
    config["models"]["policy"] = assets["policy"]
    config["data"]["prompts"] = assets["prompts"]
    config["rollout"].update(prompts_per_generate=16)
    config["learner"].update(total_steps=STEPS, batch_size=16, minibatch_size=8, ppo_epochs=1)
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    return config


def test_the_agent_task_needs_its_tool():
    """The tool adds what the policy copies into it; the reward reads the policy's last answer."""
    from demos.agent import calculator, exact_answer, make_row

    row = make_row(random.Random(3))
    a, b = row["prompt"].removeprefix("add ").removesuffix(" :").replace(" ", "").split("+")
    assert calculator(f"{a} + {b}") == row["answer"] == str(int(a) + int(b))
    with pytest.raises(ValueError, match="two numbers joined by"):
        calculator("1 * 2")
    answer = " ".join(row["answer"])
    assert exact_answer([{"role": "assistant", "content": "<tool_call> ..."}, {"role": "tool", "content": "1"},
                         {"role": "assistant", "content": answer}], "", row) == 1.0
    assert exact_answer([{"role": "assistant", "content": answer + " 1"}], "", row) == 0.0
    assert exact_answer(None, answer, row) == 1.0


@pytest.mark.slow
def test_episodes_at_k0_train_exactly_what_vllm_sampled(tmp_path, agent_assets):
    """k = 0: every step after the first trains episodes generated after an in-place weight update,
    tool calls and their results among them; the learner's logprobs of the policy's tokens are
    vLLM's (behavior_logprob_gap < 1e-3), so the ids trained are the ids sampled, turn after turn."""
    config = agent_config(tmp_path, agent_assets, buffer={"max_staleness": 0})
    run_to_the_end(tmp_path, config)
    steps = read_metrics(config["run_dir"], "learner")
    gaps = [record["behavior_logprob_gap"] for record in steps[1:]]
    assert len(gaps) == STEPS - 1 and max(gaps) < LOGPROB_TOLERANCE, gaps
    rollout = read_metrics(config["run_dir"], "rollout0")
    assert sum(r.get("episodes", 0) for r in rollout) >= STEPS * 16
    assert max(r.get("turns_per_episode", 0) for r in rollout) > 1  # the tool was called: multi-turn episodes


@pytest.mark.slow
def test_the_agent_demo_runs_colocated_on_two_engines_one_version_off_policy(tmp_path, agent_assets):
    """k = 1 and two rollout engines, colocated (placement.mode colocate): both engines generate
    episodes in the same generate turns, each on a core of its own, and the turn ends only when both
    have sent every episode they were granted, tool calls and all. The run ends, every episode is
    accounted for and none trained past the bound. Each engine runs at most 4 prompts at once: with
    16, the first engine ready could take all 64 episodes of the run before the second had asked."""
    config = agent_config(tmp_path, agent_assets, rollout={"engines": 2, "prompts_per_generate": 4},
                          buffer={"max_staleness": 1})
    run_to_the_end(tmp_path, config, mode="colocate")
    for engine in ("rollout0", "rollout1"):
        assert sum(r.get("episodes", 0) for r in read_metrics(config["run_dir"], engine)) > 0, engine
    with open(os.path.join(config["run_dir"], "metrics", "buffer_accounting.json")) as file:
        accounting = json.load(file)
    assert accounting["identity_holds"] and accounting["staleness_violations"] == 0
    assert accounting["trained"] == STEPS * 16 and set(accounting["staleness_histogram"]) <= {"0", "1"}
    steps = read_metrics(config["run_dir"], "learner")
    assert [record["step"] for record in steps] == list(range(1, STEPS + 1))
    buffer = read_metrics(config["run_dir"], "buffer")[-1]
    assert buffer["turns_train"] == STEPS and buffer["turns_generate"] >= STEPS // 2, buffer


@pytest.mark.slow
def test_tether_eval_runs_episodes_and_gives_the_same_figures_twice(tmp_path, agent_assets):
    """`tether eval` on the agent task: episodes with the tool (every turn seeded, so the same
    checkpoint gives the same figures, whatever order the tool's latency puts turns in), and worst
    cases written as whole conversations."""
    from tests.helpers import tether

    config = agent_config(tmp_path, agent_assets, eval={"prompts": agent_assets["eval_prompts"], "max_prompts": 48})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    for _ in range(2):
        result = tether("eval", agent_assets["policy"], "-c", str(path), "--step", "0", timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    first, second = [{k: v for k, v in record.items() if k not in ("time", "eval_s")}
                     for record in read_metrics(config["run_dir"], "eval")]
    assert first == second and first["prompts"] == 48 and first["tool_calls_per_episode"] > 0
    worst = (tmp_path / "run" / "eval" / "step-000000.md").read_text()
    assert "  - user: `add " in worst and "  - ended: " in worst


@pytest.mark.slow
def test_an_openai_client_program_gives_the_native_episodes_tokens(tmp_path, agent_assets):
    """The task as a program written against the OpenAI API (demos.agent.openai_agent, through the
    rollout's endpoint) and as native episodes with the calculator tool, on one vLLM engine with
    each turn seeded alike: every episode is the same prompt, token stream, mask and logprobs, the
    program's reward the exact answer of that conversation. Episodes where the policy wrote a call
    the parser cannot read are left out: the native path answers it with an error, a program
    reads it as text. The same task against the completions API (demos.agent.completions_agent,
    its own transcript as text) gives the same token streams too."""
    import logging

    import numpy as np
    from transformers import AutoTokenizer
    from vllm.sampling_params import RequestOutputKind

    from common.config import load_config
    from common.prompts import prompt_token_ids, read_rows
    from demos.agent import exact_answer
    from rollout.agents import agent_programs
    from rollout.engine import make_vllm_engine, sampling_params
    from rollout.environments import Environments
    from rollout.episodes import Episodes, Renderer
    from rollout.generators import generate_to_end
    from rollout.tools import load_tools

    native_config = load_config(None, base=agent_config(tmp_path, agent_assets))
    agent_config_ = load_config(None, ["rollout.tools=[]", "rollout.agent=demos.agent:openai_agent"],
                                base=agent_config(tmp_path, agent_assets))
    tokenizer = AutoTokenizer.from_pretrained(agent_assets["policy"])
    rows = read_rows(agent_assets["prompts"])[:24]
    engine = make_vllm_engine(native_config, enable_chunked_prefill=False)  # seeded requests: prefills whole

    def episodes(config, environments):
        prompts = [prompt_token_ids(row, tokenizer, None, environments.tool_schemas) for row in rows]
        source = Episodes(config, environments, Renderer(tokenizer, environments.tool_schemas), tokenizer, rows,
                          prompts, list(range(len(rows))), lambda episode, max_tokens: sampling_params(
                              config, n=1, max_tokens=max_tokens, seed=100 * episode.group.prompt_index + episode.turns,
                              output_kind=RequestOutputKind.FINAL_ONLY), logging.getLogger("test"))
        return generate_to_end(engine, source, list(range(len(rows))))

    completions_config = load_config(None, ["rollout.tools=[]", "rollout.agent=demos.agent:completions_agent"],
                                     base=agent_config(tmp_path, agent_assets))
    programs = agent_programs(agent_config_, tokenizer)
    completing = agent_programs(completions_config, tokenizer)
    try:
        native, native_dropped = episodes(native_config, Environments.load(None, load_tools(
            ["demos.agent:calculator"])).read_calls_with("hermes", tokenizer))
        agent, agent_dropped = episodes(agent_config_, Environments.load(None, {}, programs).read_calls_with(
            "hermes", tokenizer))
        completed, completed_dropped = episodes(completions_config, Environments.load(None, {}, completing))
    finally:
        programs.close()
        completing.close()
        engine.llm_engine.engine_core.shutdown()
    # the completions API: the program's text, each piece tokenized alone past the engine's ids
    assert completed_dropped == 0 and len(completed) == len(rows)
    compared = multi_turn = 0
    for ours, theirs in zip(native, completed):
        if "error: " in ours.messages:  # a call the policy wrote wrong: the native path's own message
            continue
        compared += 1
        multi_turn += int(ours.loss_mask.min() == 0)
        assert ours.prompt_tokens.tolist() == theirs.prompt_tokens.tolist()
        assert ours.response_tokens.tolist() == theirs.response_tokens.tolist()
        assert ours.loss_mask.tolist() == theirs.loss_mask.tolist()
        assert np.abs(ours.behavior_logprobs - theirs.behavior_logprobs).max() < LOGPROB_TOLERANCE
    assert compared >= 16 and multi_turn >= 3, (compared, multi_turn)
    assert native_dropped == agent_dropped == 0 and len(native) == len(agent) == len(rows)
    compared = multi_turn = 0
    for ours, theirs in zip(native, agent):
        if "malformed tool call" in ours.messages:
            continue
        compared += 1
        multi_turn += int(ours.loss_mask.min() == 0)
        assert ours.prompt_tokens.tolist() == theirs.prompt_tokens.tolist()
        assert ours.response_tokens.tolist() == theirs.response_tokens.tolist(), (ours.messages, theirs.messages)
        assert ours.loss_mask.tolist() == theirs.loss_mask.tolist()
        assert np.abs(ours.behavior_logprobs - theirs.behavior_logprobs).max() < LOGPROB_TOLERANCE
        row = rows[ours.data_row]
        assert float(theirs.turn_rewards.sum()) == exact_answer(json.loads(ours.messages), "", row)
    assert compared >= 16 and multi_turn >= 3, (compared, multi_turn)
