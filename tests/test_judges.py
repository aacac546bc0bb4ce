"""LLM judges in the scorer (scorer.judges): what is refused before anything starts, how an answer is
read, and a real vLLM engine's verdicts, scores and win rates against a plain transformers pass."""

import json
import logging

import numpy as np
import pytest
import torch

from common.config import ConfigError, JudgeConfig
from demos.judge import question_ids
from protocol.samples import Sample

ROWS = [{"prompt": "even 1 2 :", "answer": "2"}, {"prompt": "odd 0 0 :", "answer": "1"}]
VERDICT = "{{ prompt }} {{ response }} right ?"
PAIRWISE = "{{ prompt }} {{ response }} {{ other }} right ?"


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    from demos.judge import build_judge

    return build_judge(str(tmp_path_factory.mktemp("judge")), steps=200, log=lambda *_: None)


def judge(judge_dir, rows=ROWS, policy=None, **settings):
    from scorer.judges import Judge

    config = JudgeConfig(**{"model": judge_dir, "prompt": VERDICT, "verdict": ["Yes", "No"], **settings})
    return Judge(config, "j", "scorer.judges[0]", policy or judge_dir, rows)


def test_a_template_field_no_row_has_is_refused_naming_the_judge(judge_dir):
    with pytest.raises(ConfigError, match=r"scorer.judges\[0\].prompt: the template reads \['reference'\], which no "
                                          r"sample has \(the rows have \['answer', 'prompt'\]"):
        judge(judge_dir, prompt="{{ response }} {{ reference }}")
    assert judge(judge_dir, prompt="{{ response }} {{ answer }} {{ row.answer }}")  # a row's field, both ways
    with pytest.raises(ConfigError, match=r"a pairwise judge's template must show the response compared with"):
        judge(judge_dir, mode="pairwise")


def test_a_verdict_of_more_than_one_token_and_a_pattern_without_a_group_are_refused(judge_dir):
    with pytest.raises(ConfigError, match=r"scorer.judges\[0\].verdict: 'Yes please' is 2 tokens of .*each verdict "
                                          r"must be one token"):
        judge(judge_dir, verdict=["Yes please", "No"])
    with pytest.raises(ValueError, match="has no group"):
        JudgeConfig(model=judge_dir, prompt=VERDICT, pattern=r"\d", range=[0, 9])
    with pytest.raises(ValueError, match="a pattern needs \\[low, high\\]"):
        JudgeConfig(model=judge_dir, prompt=VERDICT, pattern=r"(\d)")
    with pytest.raises(ValueError, match="by verdict or by pattern"):
        JudgeConfig(model=judge_dir, prompt=VERDICT)
    with pytest.raises(ValueError, match=r"max_model_len \(128\) leaves no room for the question beside the answer's "
                                         "256 tokens"):
        JudgeConfig(model=judge_dir, prompt=VERDICT, pattern=r"(\d)", range=[0, 9], max_model_len=128)
    with pytest.raises(ValueError, match="21 verdicts; vLLM gives the logprobs of at most 20 tokens"):
        JudgeConfig(model=judge_dir, prompt=VERDICT, verdict=[str(i) for i in range(21)])


def test_a_judge_that_does_not_fit_the_scorers_memory_is_refused_naming_its_key(judge_dir):
    from common.engines import EngineSpec
    from scorer.judges import check_fits

    spec = EngineSpec(model=judge_dir, dtype="float32", seed=0, max_model_len=None, kv_cache_gib=4.0,
                      gpu_memory_utilization=0.3)
    with pytest.raises(ConfigError, match=r"scorer.judges\[1\].model: .* does not fit the scorer's memory: it needs "
                                          r"[0-9.]+ GiB of weights and a 4 GiB KV cache, 4.00 GiB, and 1.00 GiB are free"):
        check_fits(spec, "scorer.judges[1]", cuda=False, available=2**30)
    check_fits(spec, "scorer.judges[1]", cuda=False, available=5 * 2**30)


def test_a_judge_of_the_policys_tokens_reads_a_response_as_the_ids_the_policy_sampled(judge_dir):
    """Same tokenizer: the response's ids go into the question as they are, where its text would be."""
    same = judge(judge_dir)
    assert same.same_tokens
    variables = {"prompt": "even 1 2 :", "response": "2 4", "messages": None, "row": ROWS[0]}
    ids = same.tokenizer.encode("2 4", add_special_tokens=False)
    assert same.question(variables, ids) == same.question(variables)  # this text tokenizes to those ids
    swapped = same.question(variables, ids[::-1])
    assert swapped != same.question(variables) and ids[::-1] == swapped[-len(ids) - 3:-3]  # then "right ? <assistant>"
    # a template that filters the response reads its text: the ids could not stand where it was
    filtered = judge(judge_dir, prompt="{{ prompt }} {{ response | upper }} right ?")
    assert filtered.question(variables, ids[::-1]) == filtered.question(variables)


class Output:
    """The parts of a vLLM output a judge reads."""

    def __init__(self, token_ids, logprobs=None):
        self.outputs = [type("Completion", (), {"token_ids": token_ids, "logprobs": logprobs})()]


def test_a_pattern_reads_the_last_match_within_its_range_and_anything_else_is_unparsed(judge_dir):
    scored = judge(judge_dir, verdict=None, pattern=r"(\d) \?", range=[2, 6])
    ids = scored.tokenizer.encode
    assert scored.read(Output(ids("1 ? right 5 ?", add_special_tokens=False)))[0] == pytest.approx(0.75)
    assert scored.read(Output(ids("9 ?", add_special_tokens=False)))[0] is None  # outside [2, 6]
    assert scored.read(Output(ids("right", add_special_tokens=False))) == (None, "right")


def test_a_verdict_is_the_first_verdicts_probability_normalised_over_the_verdicts(judge_dir):
    from vllm.logprobs import Logprob

    verdicts = judge(judge_dir)
    yes, no = verdicts.verdict_ids
    read = verdicts.read(Output([no], [{yes: Logprob(np.log(0.2)), no: Logprob(np.log(0.6))}]))
    assert read[0] == pytest.approx(0.25) and read[1] == "No"


# --------------------------------------------------------------------------- on a real engine


def transformers_yes(judge_dir, contents: list[str]) -> list[float]:
    """P(Yes) / (P(Yes) + P(No)) at the answer's position, from a plain forward pass of each question."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(judge_dir)
    model = AutoModelForCausalLM.from_pretrained(judge_dir).eval()
    yes, no = tokenizer.convert_tokens_to_ids(["Yes", "No"])
    values = []
    with torch.no_grad():
        for content in contents:
            ids = question_ids(tokenizer, content)
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            values.append(float(torch.softmax(logits[[yes, no]].double(), dim=-1)[0]))
    return values


def transformers_greedy(judge_dir, content: str, max_tokens: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(judge_dir)
    model = AutoModelForCausalLM.from_pretrained(judge_dir).eval()
    ids = question_ids(tokenizer, content)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=2,
                             pad_token_id=0)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


@pytest.mark.slow
def test_a_judges_verdicts_scores_and_win_rates_from_the_scorers_engine_equal_a_transformers_pass(
        tmp_path, tiny_assets, judge_dir, caplog):
    """One engine serves three judges of one model: a verdict judge (weight 1), a pairwise one
    (weight 2; groups of two) and a pattern judge per turn (its turn reward, a digit / 9, greedy;
    an answer without a digit is unparsed and drops its group)."""
    import re

    from tests.test_scorer import make_scorer

    judges = [{"model": judge_dir, "prompt": VERDICT, "verdict": ["Yes", "No"], "name": "verdict"},
              {"model": judge_dir, "prompt": PAIRWISE, "verdict": ["Yes", "No"], "mode": "pairwise", "weight": 2.0,
               "name": "pairwise"},
              {"model": judge_dir, "prompt": VERDICT, "pattern": r"(\d)", "range": [0, 9], "max_tokens": 6,
               "per_turn": True, "on_unparsed": "drop_group", "name": "digits"}]
    scorer = make_scorer(tmp_path, tiny_assets, prompts_rows=ROWS, models={"reward": None},
                         rollout={"samples_per_prompt": 2}, scorer={"judges": judges})
    pairs = [([1, 3, 7, 8, 5], [8, 10, 12, 6, 2]), ([1, 3, 7, 8, 5], [9, 2]), ([1, 4, 6, 6, 5], [9, 8, 2]),
             ([1, 4, 6, 6, 5], [8, 11, 2])]
    samples = [Sample(f"s{i}", i // 2, 0, np.array(p, np.int32), np.array(r, np.int32), np.zeros(len(r), np.float32),
                      "stop", data_row=i // 2) for i, (p, r) in enumerate(pairs)]
    with caplog.at_level(logging.WARNING):
        parts = scorer.score(samples)
    scorer.close()
    decode = scorer.tokenizer.decode
    prompts = [decode(p, skip_special_tokens=True) for p, _ in pairs]
    responses = [decode(r, skip_special_tokens=True) for _, r in pairs]
    verdicts = transformers_yes(judge_dir, [f"{p} {r} right ?" for p, r in zip(prompts, responses)])
    other = [1, 0, 3, 2]  # each one's group's other response
    wins = transformers_yes(judge_dir, [f"{p} {r} {responses[o]} right ?"
                                        for p, r, o in zip(prompts, responses, other)])
    np.testing.assert_allclose([s.reward for s in samples], np.array(verdicts) + 2.0 * np.array(wins), atol=1e-4)
    assert parts["judge:verdict"] == pytest.approx(np.mean(verdicts), abs=1e-4)
    for sample, prompt, response in zip(samples, prompts, responses):
        answer = transformers_greedy(judge_dir, f"{prompt} {response} right ?", 6)
        found = re.findall(r"(\d)", answer)
        assert sample.turn_rewards.tolist()[:-1] == [0.0] * (len(sample.response_tokens) - 1)
        assert sample.turn_rewards[-1] == pytest.approx(int(found[-1]) / 9 if found else 0.0, abs=1e-6)
        assert sample.drop_reason == ("" if found else "judge_unparsed") or (
            sample.drop_reason is None and all(s.drop_reason is None for s in samples))
    unparsed = sum(s.drop_reason == "judge_unparsed" for s in samples)
    assert parts["judge_unparsed"] == parts["judge_unparsed:digits"] == unparsed
    assert parts["judge_unparsed:verdict"] == parts["judge_unparsed:pairwise"] == 0
    if unparsed:
        assert caplog.text.count("judge digits's answer to sample") == 1
    assert json.dumps(parts)  # the metrics record holds it
