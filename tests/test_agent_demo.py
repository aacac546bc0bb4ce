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


def test_the_agent_demos_framework_is_one_it_knows_and_one_way_at_a_time(monkeypatch):
    """`tether demo --agent --framework <name>`: a name it does not know, or a second way of running
    the episodes, is refused before anything is built; a known one runs the demo with that
    framework's program (demos.agent_frameworks.FRAMEWORKS)."""
    from typer.testing import CliRunner

    import demos.agent
    from demos.agent_frameworks import FRAMEWORKS, overrides
    from launch.cli import app
    from launch.exit_codes import ExitCode

    result = CliRunner().invoke(app, ["demo", "--agent", "--framework", "crewai"])
    assert result.exit_code == ExitCode.CONFIG_ERROR and "--framework crewai: one of openai-agents" in result.output
    result = CliRunner().invoke(app, ["demo", "--agent", "--openai", "--framework", "langgraph"])
    assert result.exit_code == ExitCode.CONFIG_ERROR and "one at a time" in result.output
    ran = []
    monkeypatch.setattr(demos.agent, "run_demo", lambda *arguments: ran.append(arguments) or 0)
    assert CliRunner().invoke(app, ["demo", "--agent", "--framework", "openai-agents"]).exit_code == 0
    assert sorted(FRAMEWORKS) == ["anthropic", "langgraph", "openai-agents", "smolagents"]
    assert ran[0][1] == overrides("openai-agents") and "rollout.tools=[]" in ran[0][1]
    assert "rollout.agent=demos.agent_frameworks:openai_agents" in ran[0][1]


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
    episodes in the same generate shifts, each on a core of its own, and the shift ends only when both
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
    assert buffer["shifts_train"] == STEPS and buffer["shifts_generate"] >= STEPS // 2, buffer


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


class SeededEpisodes:
    """One vLLM engine on the agent demo's policy, whose episodes' turns are each seeded by prompt
    and turn, so that two ways of running the same task give the same token streams; the native
    episodes with the calculator tool, run once for every test that compares with them."""

    def __init__(self, tmp_path, assets) -> None:
        from transformers import AutoTokenizer

        from common.config import load_config
        from common.prompts import read_rows
        from rollout.engine import make_vllm_engine
        from environments.native import Environments
        from environments.tools import load_tools

        self.tmp_path, self.assets = tmp_path, assets
        self.tokenizer = AutoTokenizer.from_pretrained(assets["policy"])
        self.rows = read_rows(assets["prompts"])[:24]
        native_config = load_config(None, base=agent_config(tmp_path, assets))
        self.engine = make_vllm_engine(native_config, enable_chunked_prefill=False)  # seeded requests: prefills whole
        self.native, dropped = self.run(native_config, Environments.load(None, load_tools(
            ["demos.agent:calculator"])).read_calls_with("hermes", self.tokenizer))
        assert dropped == 0 and len(self.native) == len(self.rows)

    def config(self, *overrides: str):
        from common.config import load_config

        return load_config(None, ["rollout.tools=[]", *overrides], base=agent_config(self.tmp_path, self.assets))

    def run(self, config, environments):
        """Every row's episode on the engine: its samples and how many were dropped."""
        import logging

        from vllm.sampling_params import RequestOutputKind

        from common.prompts import prompt_token_ids
        from rollout.engine import sampling_params
        from rollout.episodes import Episodes, Renderer
        from rollout.generators import generate_to_end

        prompts = [prompt_token_ids(row, self.tokenizer, None, environments.tool_schemas) for row in self.rows]
        source = Episodes(config, environments, Renderer(self.tokenizer, environments.tool_schemas), self.tokenizer,
                          self.rows, prompts, list(range(len(self.rows))), lambda episode, max_tokens: sampling_params(
                              config, n=1, max_tokens=max_tokens, seed=100 * episode.group.prompt_index + episode.turns,
                              output_kind=RequestOutputKind.FINAL_ONLY), logging.getLogger("test"))
        return generate_to_end(self.engine, source, list(range(len(self.rows))))

    def run_programs(self, config, parse_calls: bool = True):
        """The episodes of ``config``'s agent programs (rollout.agent, a verifiers environment)."""
        from environments.agents import agent_programs
        from environments.native import Environments

        programs = agent_programs(config, self.tokenizer)
        try:
            environments = Environments.load(None, {}, programs)
            return self.run(config, environments.read_calls_with("hermes", self.tokenizer) if parse_calls
                            else environments)
        finally:
            programs.close()

    def same_streams(self, theirs, *skip: str) -> int:
        """How many of ``theirs`` were compared with the native episode of their row, and found
        the same prompt, token stream, mask and logprobs; a native episode whose messages hold one
        of ``skip`` is left out (a call the policy wrote wrong, answered differently by each way)."""
        import numpy as np

        assert len(theirs) == len(self.native)
        compared = multi_turn = 0
        for ours, other in zip(self.native, theirs):
            if any(text in ours.messages for text in skip):
                continue
            compared += 1
            multi_turn += int(ours.loss_mask.min() == 0)
            assert ours.prompt_tokens.tolist() == other.prompt_tokens.tolist()
            assert ours.response_tokens.tolist() == other.response_tokens.tolist(), (ours.messages, other.messages)
            assert ours.loss_mask.tolist() == other.loss_mask.tolist()
            assert np.abs(ours.behavior_logprobs - other.behavior_logprobs).max() < LOGPROB_TOLERANCE
        assert compared >= 16 and multi_turn >= 3, (compared, multi_turn)
        return compared

    def close(self) -> None:
        self.engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def seeded(agent_assets, tmp_path_factory):
    episodes = SeededEpisodes(tmp_path_factory.mktemp("seeded"), agent_assets)
    yield episodes
    episodes.close()


@pytest.mark.slow
def test_an_openai_client_program_gives_the_native_episodes_tokens(seeded):
    """The task as a program written against the OpenAI API (demos.agent.openai_agent, through the
    rollout's endpoint) and as native episodes with the calculator tool, on one vLLM engine with
    each turn seeded alike: every episode is the same prompt, token stream, mask and logprobs, the
    program's reward the exact answer of that conversation. Episodes where the policy wrote a call
    the parser cannot read are left out: the native path answers it with an error, a program
    reads it as text. The same task against the completions API (demos.agent.completions_agent,
    its own transcript as text) gives the same token streams too."""
    from demos.agent import exact_answer

    agent, agent_dropped = seeded.run_programs(seeded.config("rollout.agent=demos.agent:openai_agent"))
    # the completions API: the program's text, each piece tokenized alone past the engine's ids
    completed, completed_dropped = seeded.run_programs(seeded.config("rollout.agent=demos.agent:completions_agent"),
                                                       parse_calls=False)
    assert agent_dropped == completed_dropped == 0
    seeded.same_streams(completed, "error: ")
    seeded.same_streams(agent, "malformed tool call")
    for ours, theirs in zip(seeded.native, agent):
        if "malformed tool call" not in ours.messages:
            row = seeded.rows[ours.data_row]
            assert float(theirs.turn_rewards.sum()) == exact_answer(json.loads(ours.messages), "", row)
    for samples in (seeded.native, agent):
        turns_rewarded_in_place(seeded, samples)


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["openai_agents", "anthropic_messages", "langgraph"])
def test_an_agent_written_with_its_framework_gives_the_native_episodes_tokens(seeded, framework):
    """The task written with an agent framework as its docs write one (demos/agent_frameworks.py):
    the OpenAI Agents SDK over the Responses API, Anthropic's SDK over the Messages API, LangGraph's
    ReAct agent over chat completions. Through the rollout's endpoint each gives every episode the
    native episode's prompt, token stream, mask and logprobs, and the framework's own conversation
    is what was trained: its reward is the exact answer of the native conversation. Episodes where
    a tool failed or a call was malformed are left out: each framework words a failure its own way."""
    from demos.agent import exact_answer

    theirs, dropped = seeded.run_programs(seeded.config(f"rollout.agent=demos.agent_frameworks:{framework}"))
    assert dropped == 0
    seeded.same_streams(theirs, "malformed tool call", "error")
    for ours, their in zip(seeded.native, theirs):
        if "malformed tool call" not in ours.messages and "error" not in ours.messages:
            row = seeded.rows[ours.data_row]
            assert float(their.turn_rewards.sum()) == exact_answer(json.loads(ours.messages), "", row)


def turn_tokens(response_tokens):
    return float(len(response_tokens))


def assistant_turns(messages):
    return 1000.0 * sum(message["role"] == "assistant" for message in messages)


def turns_rewarded_in_place(seeded, samples) -> None:
    """Per-turn reward functions (scorer.reward_functions, per_turn) on episodes as the rollout made
    them: each turn's value sits on its last policy token, and is that turn's own (its token count)
    given the conversation up to it (its assistant messages: one more each turn)."""
    import copy
    import logging

    import numpy as np

    from common.sequences import policy_turns
    from scorer.main import Scorer

    config = seeded.config('scorer.reward_functions=[{"function": "tests.test_agent_demo:turn_tokens", '
                           '"per_turn": true}, {"function": "tests.test_agent_demo:assistant_turns", "per_turn": true}]')
    samples = [copy.copy(sample) for sample in samples]
    before = [np.array(sample.turn_rewards) for sample in samples]
    scorer = Scorer(config, logging.getLogger("test"))
    try:
        parts = scorer.score(samples)
    finally:
        scorer.close()
    assert parts["reward_failed"] == 0
    multi_turn = 0
    for sample, earlier in zip(samples, before):
        added = sample.turn_rewards - earlier
        turns = policy_turns(sample.loss_mask, len(sample.response_tokens))
        multi_turn += len(turns) > 1
        spoken = sum(message["role"] == "assistant" for message in json.loads(sample.messages))
        expected = np.zeros(len(added))
        for number, (start, stop) in enumerate(turns):
            expected[stop - 1] = (stop - start) + 1000.0 * (spoken - len(turns) + number + 1)
        np.testing.assert_allclose(added, expected)
        assert (added[sample.loss_mask == 0] == 0).all()
    assert multi_turn >= 3


@pytest.mark.slow
def test_a_verifiers_environment_gives_the_native_episodes_tokens_and_its_rubrics_reward(seeded):
    """The task as verifiers environments written with verifiers' own classes
    (demos/agent_verifiers.py), run by verifiers through the rollout's endpoint: its ToolEnv with
    the calculator gives the native episodes' token streams, its rubric's exact answer the
    reward; its SingleTurnEnv gives each episode one turn, the native episode's first, and the
    rubric's score of that turn."""
    from demos.agent import exact_answer

    tools, tools_dropped = seeded.run_programs(seeded.config("rollout.environment=verifiers:demos.agent_verifiers"))
    single, single_dropped = seeded.run_programs(seeded.config("rollout.environment=verifiers:demos.agent_verifiers",
                                                               'rollout.environment_args={"tools": false}'))
    assert tools_dropped == single_dropped == 0
    seeded.same_streams(tools, "malformed tool call")
    rewarded = 0
    for ours, theirs, one in zip(seeded.native, tools, single):
        row = seeded.rows[ours.data_row]
        if "malformed tool call" not in ours.messages:
            assert float(theirs.turn_rewards.sum()) == exact_answer(json.loads(ours.messages), "", row)
            rewarded += int(theirs.turn_rewards.sum() == 1.0)
        first_turn = ours.loss_mask.tolist().index(0) if ours.loss_mask.min() == 0 else len(ours.loss_mask)
        assert one.prompt_tokens.tolist() == ours.prompt_tokens.tolist()
        assert one.response_tokens.tolist() == ours.response_tokens[:first_turn].tolist() and one.loss_mask.min() == 1
        reward = exact_answer(None, seeded.tokenizer.decode(one.response_tokens, skip_special_tokens=True), row)
        assert float(one.turn_rewards.sum()) == reward
    assert rewarded >= 1  # the policy gets some sums right with the tool, and the rubric sees it
