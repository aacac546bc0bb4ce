"""Sequence packing and the scorer's math on real (tiny) transformers models."""

import logging

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from common.config import SamplingConfig
from common.sequences import collate, gather_response
from protocol.samples import Sample
from scorer.scoring import REWARD_OFFSET_KEY, reference_logprobs, reward_scores
from tests.helpers import sample_of


def test_collate_puts_each_response_token_after_the_logits_that_predict_it():
    batch = collate([sample_of([1, 3, 7], [9, 2]), sample_of([1, 4], [8, 8, 8, 2])], pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 3, 7, 9, 2, 0], [1, 4, 8, 8, 8, 2]]
    assert batch.response_positions.tolist() == [[2, 3, 0, 0], [1, 2, 3, 4]]
    assert batch.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch.last_positions.tolist() == [4, 5]
    # positions pick the row the token follows: input_ids at position p + 1 is the token scored at p
    following = gather_response(batch.input_ids[:, 1:], batch.response_positions.clamp(max=4))
    assert (following * batch.response_mask.long()).tolist() == [[9, 2, 0, 0], [8, 8, 8, 2]]


def test_reference_logprobs_match_a_plain_forward_pass_whatever_the_padding(tiny_assets):
    reference = AutoModelForCausalLM.from_pretrained(tiny_assets["policy"]).eval()
    short, long = sample_of([1, 3, 7, 8, 5], [9, 2], "a"), sample_of([1, 4, 6, 6, 5], [8, 10, 12, 6, 2], "b")
    batched = reference_logprobs(reference, [short, long], pad_token_id=0, sampling=SamplingConfig(temperature=0.7))
    with torch.no_grad():
        ids = torch.tensor([[1, 3, 7, 8, 5, 9, 2]])
        expected = torch.log_softmax(reference(input_ids=ids).logits[0, 4:6] / 0.7, dim=-1)
        expected = expected[torch.arange(2), torch.tensor([9, 2])]
    torch.testing.assert_close(batched[0], expected, atol=1e-5, rtol=0)
    alone = reference_logprobs(reference, [long], pad_token_id=0, sampling=SamplingConfig(temperature=0.7))
    torch.testing.assert_close(batched[1], alone[0], atol=1e-5, rtol=0)


def test_reward_scores_use_the_last_real_token_and_subtract_the_offset(tiny_assets):
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_assets["reward"], num_labels=1).eval()
    offset = getattr(rm.config, REWARD_OFFSET_KEY)
    a, b = sample_of([1, 3, 7, 8, 5], [9, 2], "a"), sample_of([1, 4, 6, 6, 5], [8, 10, 12, 6, 2], "b")
    together = reward_scores(rm, [a, b], pad_token_id=0)
    assert together.shape == (2,)
    torch.testing.assert_close(together[0], reward_scores(rm, [a], pad_token_id=0)[0], atol=1e-5, rtol=0)
    with torch.no_grad():
        hidden = rm.base_model(input_ids=torch.tensor([[1, 4, 6, 6, 5, 8, 10, 12, 6, 2]])).last_hidden_state
        expected = rm.score(hidden[0, -1]).item() - offset
    assert together[1].item() == pytest.approx(expected, abs=1e-5)


# --------------------------------------------------------------------------- the Scorer: RM with its
# own tokenizer, reward functions, both or either


def own_tokenizer_reward_model(directory, chat_template=None):
    """A reward model that reads another vocabulary than the policy's: the demo's words in another
    order, other special tokens, `[CLS] text [SEP]` framing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    from demos.parity import VOCAB

    words = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "user", "assistant"] + list(reversed(VOCAB[3:]))
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                        special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]",
                                        cls_token="[CLS]", sep_token="[SEP]")
    if chat_template:
        tokenizer.chat_template = chat_template
    torch.manual_seed(3)
    model = LlamaForSequenceClassification(LlamaConfig(vocab_size=len(words), hidden_size=64, intermediate_size=128,
                                                       num_hidden_layers=2, num_attention_heads=2, num_labels=1,
                                                       pad_token_id=0))
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return tokenizer, model.eval()


def make_scorer(tmp_path, tiny_assets, prompts_rows=None, **sections):
    import json
    import logging

    from common.config import load_config
    from scorer.main import Scorer
    from tests.helpers import base_config

    base = base_config(tmp_path, tiny_assets, **sections)
    if prompts_rows is not None:
        path = tmp_path / "prompts.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in prompts_rows))
        base["data"]["prompts"] = str(path)
    return Scorer(load_config(None, base=base), logging.getLogger("test-scorer"))


PROMPTS = [[1, 3, 7, 8, 5], [1, 4, 6, 6, 5]]  # <bos> even 1 2 : / <bos> odd 0 0 :
RESPONSES = [[9, 11, 2], [8, 10, 12, 6, 2]]


def scored_samples(scorer, data_rows=(0, 1)):
    samples = [Sample(f"s{i}", i, 0, np.array(p, np.int32), np.array(r, np.int32), np.zeros(len(r), np.float32),
                      "stop", data_row=row) for i, (p, r, row) in enumerate(zip(PROMPTS, RESPONSES, data_rows))]
    parts = scorer.score(samples)
    return samples, parts


def test_a_reward_model_with_its_own_vocabulary_scores_the_text_as_its_own_tokenizer_does(tmp_path, tiny_assets):
    from transformers import AutoTokenizer

    rm_dir = str(tmp_path / "rm")
    rm_tokenizer, rm = own_tokenizer_reward_model(rm_dir)
    scorer = make_scorer(tmp_path, tiny_assets, models={"reward": rm_dir})
    assert scorer.rm_tokenizer is not None  # detected: the ids would mean other words to it
    samples, parts = scored_samples(scorer)

    policy_tokenizer = AutoTokenizer.from_pretrained(tiny_assets["policy"])
    for sample, prompt, response in zip(samples, PROMPTS, RESPONSES):
        text = policy_tokenizer.decode(prompt + response, skip_special_tokens=True)  # "even 1 2 : 3 5"
        encoded = rm_tokenizer(text, return_tensors="pt")
        assert encoded["input_ids"][0, 0] == 1 and encoded["input_ids"][0, -1] == 2  # its own framing
        with torch.no_grad():
            direct = rm(**encoded).logits[0, 0].item()
        assert sample.reward == pytest.approx(direct, abs=1e-5)
    assert samples[0].reward != pytest.approx(samples[1].reward, abs=1e-3)
    assert parts["rm_score"] == pytest.approx(np.mean([s.reward for s in samples]), abs=1e-6)

    # the same RM given the policy's tokenizer reads the ids unchanged: no decode, the ids path
    shared = make_scorer(tmp_path, tiny_assets)
    assert shared.rm_tokenizer is None and not shared.needs_text


def test_a_chat_reaches_a_reward_model_through_its_own_chat_template(tmp_path, tiny_assets):
    """The template writes the RM's special tokens itself ([CLS] here, <|begin_of_text|> in Llama 3
    RMs): they are not added a second time."""
    template = "[CLS] {% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    rm_dir = str(tmp_path / "rm")
    rm_tokenizer, rm = own_tokenizer_reward_model(rm_dir, chat_template=template)
    rows = [{"messages": [{"role": "user", "content": "even 1 2 :"}]}, {"prompt": "odd 0 0 :"}]
    scorer = make_scorer(tmp_path, tiny_assets, prompts_rows=rows, models={"reward": rm_dir})
    samples, _ = scored_samples(scorer)
    chat = [*rows[0]["messages"], {"role": "assistant", "content": "3 5"}]  # the response as the assistant's turn
    ids = rm_tokenizer.apply_chat_template(chat, tokenize=True)["input_ids"]
    assert ids == rm_tokenizer("[CLS] user even 1 2 : assistant 3 5", add_special_tokens=False)["input_ids"]
    assert ids.count(1) == 1  # one [CLS]
    with torch.no_grad():
        direct = rm(input_ids=torch.tensor([ids])).logits[0, 0].item()
    assert samples[0].reward == pytest.approx(direct, abs=1e-5)


def exact_parity(prompt, response):
    """A verifiable reward of the demo's task: the fraction of response digits of the named parity."""
    wanted = 0 if prompt.startswith("even") else 1
    digits = [int(word) for word in response.split() if word.isdigit()]
    return sum(d % 2 == wanted for d in digits) / len(digits) if digits else 0.0


def length_bonus(response_tokens, row):
    return row["bonus"] * len(response_tokens)


def broken(response):
    raise RuntimeError("no answer key")


def test_reward_functions_are_trained_on_added_to_the_rm_and_a_failing_one_costs_nothing_else(
        tmp_path, tiny_assets, caplog):
    rows = [{"prompt": "even 1 2 :", "bonus": 0.5}, {"prompt": "odd 0 0 :", "bonus": 2.0}]
    functions = [{"function": "tests.test_scorer:exact_parity", "weight": 2.0},
                 {"function": "tests.test_scorer:length_bonus", "weight": 1.0},
                 {"function": "tests.test_scorer:broken", "weight": 5.0}]
    rm_only = make_scorer(tmp_path, tiny_assets, prompts_rows=rows)
    rm_scores = [s.reward for s in scored_samples(rm_only)[0]]
    scorer = make_scorer(tmp_path, tiny_assets, prompts_rows=rows, scorer={"reward_functions": functions})
    with caplog.at_level(logging.WARNING):  # whatever level an earlier test's role left the root logger at
        samples, parts = scored_samples(scorer)
    # "3 5" for even: 0 of 2 digits right; "2 4 6 0" for odd: 0 of 4 right
    parity = [exact_parity("even 1 2 :", "3 5"), exact_parity("odd 0 0 :", "2 4 6 0")]
    assert parity == [0.0, 0.0]
    expected = [rm + 2.0 * p + bonus * len(r) for rm, p, bonus, r in zip(rm_scores, parity, (0.5, 2.0), RESPONSES)]
    assert [s.reward for s in samples] == pytest.approx(expected, abs=1e-5)
    assert parts["reward_failed"] == 2 and parts["tests.test_scorer:broken"] == 0.0
    assert "reward tests.test_scorer:broken failed on sample s0" in caplog.text
    assert "no answer key" in caplog.text


def test_verifiable_rewards_alone_need_no_reward_model(tmp_path, tiny_assets):
    functions = [{"function": "tests.test_scorer:exact_parity", "weight": 1.0}]
    scorer = make_scorer(tmp_path, tiny_assets, models={"reward": None}, scorer={"reward_functions": functions})
    assert scorer.reward_model is None
    # <bos> even 1 2 : -> "2 4 6 0" (all even); <bos> odd 0 0 : -> "3 2" (half odd)
    pairs = [([1, 3, 7, 8, 5], [8, 10, 12, 6, 2]), ([1, 4, 6, 6, 5], [9, 8, 2])]
    samples = [Sample(f"s{i}", i, 0, np.array(p, np.int32), np.array(r, np.int32), np.zeros(len(r), np.float32),
                      "stop") for i, (p, r) in enumerate(pairs)]
    parts = scorer.score(samples)
    assert [s.reward for s in samples] == [1.0, 0.5] and "rm_score" not in parts
    assert parts["tests.test_scorer:exact_parity"] == 0.75

    # the first episode in two parts (its program rewrote its context): only the last part is scored
    cut = Sample("s0a", 0, 0, np.array([1, 3, 7], np.int32), np.array([9, 9], np.int32), np.zeros(2, np.float32),
                 "restart", episode_index=0, part_index=0, episode_parts=2)
    for i, s in enumerate(samples):
        s.episode_index, s.part_index, s.episode_parts = i, int(i == 0), 2 if i == 0 else 1
    parts = scorer.score([cut, *samples])
    assert [s.reward for s in (cut, *samples)] == [0.0, 1.0, 0.5] and cut.ref_logprobs.shape == (2,)
    assert parts["tests.test_scorer:exact_parity"] == 0.75  # over episodes, the cut conversation not among them
    # nothing but the pass's shares (one row: no padding, no prefix another row has)
    assert scorer.score([cut]) == {"reward_failed": 0, "padding_share": 0.0, "prefix_share": 0.0}
    assert cut.reward == 0.0


def test_the_critic_starts_from_the_reward_model_only_when_it_reads_the_policys_tokens(tmp_path, tiny_assets):
    from common.config import ConfigError, load_config
    from common.models import critic_source
    from tests.helpers import base_config

    rm_dir = str(tmp_path / "rm")
    own_tokenizer_reward_model(rm_dir)

    def source(**models):
        return critic_source(load_config(None, base=base_config(tmp_path, tiny_assets, models=models)))

    assert source() == tiny_assets["reward"]  # auto, the demo RM shares the policy's tokenizer
    assert source(reward=rm_dir) == tiny_assets["policy"]  # auto, an RM of other tokens: the policy
    with pytest.raises(ConfigError, match="models.critic_init: the reward model .* has a tokenizer of its own"):
        source(reward=rm_dir, critic_init="reward")


def test_a_reference_that_reads_other_tokens_is_refused_naming_the_key(tmp_path, tiny_assets):
    from common.config import ConfigError

    rm_dir = str(tmp_path / "rm")
    own_tokenizer_reward_model(rm_dir)
    with pytest.raises(ConfigError, match="models.reference: .* reads other tokens than the policy"):
        make_scorer(tmp_path, tiny_assets, models={"reference": rm_dir})


def test_the_scorer_runs_its_models_in_models_dtype(tmp_path, tiny_assets):
    full = scored_samples(make_scorer(tmp_path, tiny_assets))[0]
    half_scorer = make_scorer(tmp_path, tiny_assets, models={"dtype": "bfloat16"})
    assert next(half_scorer.reference.parameters()).dtype == torch.bfloat16
    half = scored_samples(half_scorer)[0]
    for a, b in zip(half, full):
        assert a.ref_logprobs.dtype == np.float32  # on the wire in fp32 whatever the models' dtype
        np.testing.assert_allclose(a.ref_logprobs, b.ref_logprobs, atol=0.1)
        assert a.reward == pytest.approx(b.reward, abs=0.1)


def test_the_overlong_shaping_is_a_reward_term_the_scorer_adds_and_reports(tmp_path, tiny_assets):
    """RESPONSES are 3 and 5 tokens long: at a limit of 5 with a buffer of 4, the first is 2 tokens
    into the buffer and loses 2/4 of the penalty 2, the second reached the limit and loses all of it."""
    plain = make_scorer(tmp_path, tiny_assets)
    base = [s.reward for s in scored_samples(plain)[0]]
    shaped = make_scorer(tmp_path, tiny_assets, scorer={"overlong_buffer": 4, "overlong_penalty": 2.0,
                                                        "overlong_max_length": 5})
    samples, parts = scored_samples(shaped)
    assert [s.reward for s in samples] == pytest.approx([base[0] - 1.0, base[1] - 2.0], abs=1e-5)
    assert parts["overlong_penalty"] == pytest.approx(-1.5) and parts["overlong_frac"] == 1.0


def test_a_teachers_logprobs_from_the_scorer_equal_a_plain_forward_at_the_rollouts_sampling(tmp_path, tiny_assets):
    """On-policy distillation: the scorer's teacher_logprobs are the teacher's log-softmax at the
    rollout's temperature on each response token, as a plain transformers pass gives them."""
    scorer = make_scorer(tmp_path, tiny_assets, models={"teacher": tiny_assets["base"]},
                         sampling={"temperature": 0.7})
    samples, _ = scored_samples(scorer)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_assets["base"]).eval()
    for sample in samples:
        ids = torch.tensor([sample.prompt_tokens.tolist() + sample.response_tokens.tolist()])
        with torch.no_grad():
            logits = teacher(input_ids=ids).logits[0, len(sample.prompt_tokens) - 1:-1] / 0.7
        expected = torch.log_softmax(logits, dim=-1)[torch.arange(len(sample.response_tokens)),
                                                     torch.tensor(sample.response_tokens.tolist())]
        np.testing.assert_allclose(sample.teacher_logprobs, expected.numpy(), atol=1e-5, rtol=0)
        assert not np.allclose(sample.teacher_logprobs, sample.ref_logprobs, atol=1e-3)  # another model's
    assert "a teacher's logprobs" in scorer.describe()


def test_a_teacher_that_reads_other_tokens_is_refused_naming_both_models(tmp_path, tiny_assets):
    from common.config import ConfigError

    rm_dir = str(tmp_path / "rm")
    own_tokenizer_reward_model(rm_dir)
    with pytest.raises(ConfigError, match=rf"models.teacher: {rm_dir} reads other tokens than the policy \(.*sft\)"):
        make_scorer(tmp_path, tiny_assets, models={"teacher": rm_dir})
