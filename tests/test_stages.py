"""tether sft, rm, dpo and pipeline: the stages' math against the pair-by-pair and hand-computed
forms, their data rows, and each command run for real (DeepSpeed, transformers) with what it
reports checked against another way of computing it."""

import itertools
import json
import math
import shutil

import pytest
import torch
import yaml

from common.config import ConfigError, load_config
from launch.exit_codes import ExitCode
from stages.examples import demonstration, padded, ranking, read_examples
from stages.losses import dpo_loss, kwise_ranking_loss, sequence_logprobs, token_nll
from tests.helpers import chatml_tokenizer, tether


def pairwise_loss(scores: list[float], ranks: list[int]) -> float:
    """The InstructGPT loss one pair at a time: the mean over the pairs of -log sigmoid(r_w - r_l)."""
    losses = [-math.log(1 / (1 + math.exp(-(scores[i] - scores[j]))))
              for i, j in itertools.permutations(range(len(scores)), 2) if ranks[i] < ranks[j]]
    return sum(losses) / len(losses)


# --------------------------------------------------------------------------- the math


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_kwise_loss_is_the_mean_of_the_pairwise_losses(k):
    generator = torch.Generator().manual_seed(k)
    scores = torch.randn(6, k, generator=generator, dtype=torch.float64)
    ranks = torch.stack([torch.randperm(k, generator=generator) for _ in range(6)])
    loss, pairs, correct = kwise_ranking_loss(scores, ranks, torch.ones(6, k, dtype=torch.bool))
    for g in range(6):
        assert float(loss[g]) == pytest.approx(pairwise_loss(scores[g].tolist(), ranks[g].tolist()), rel=1e-12)
        assert int(pairs[g]) == k * (k - 1) // 2
        assert int(correct[g]) == sum(scores[g, i] > scores[g, j] for i in range(k) for j in range(k)
                                      if ranks[g, i] < ranks[g, j])


def test_kwise_loss_with_ties_and_groups_of_different_sizes():
    scores = torch.tensor([[1.0, 0.0, 2.0, 9.0], [0.5, -0.5, 0.0, 0.0], [3.0, 3.0, 0.0, 0.0]])
    ranks = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    present = torch.tensor([[True, True, True, False], [True, True, False, False], [True, True, False, False]])
    loss, pairs, correct = kwise_ranking_loss(scores, ranks, present)
    # group 0: response 3 is padding; 1 and 2 tie, so the pairs are (0, 1) and (0, 2)
    assert pairs.tolist() == [2, 1, 0]
    assert float(loss[0]) == pytest.approx(pairwise_loss([1.0, 0.0, 2.0], [0, 1, 1]))
    assert float(loss[1]) == pytest.approx(-math.log(1 / (1 + math.exp(1.0))))  # the better one scores lower
    assert float(loss[2]) == 0.0 and correct.tolist() == [1, 0, 0]  # a tie is no pair


def test_dpo_loss_by_hand():
    loss, chosen, rejected = dpo_loss(torch.tensor([-3.0]), torch.tensor([-5.0]), torch.tensor([-4.0]),
                                      torch.tensor([-4.5]), beta=0.1)
    # chosen gained 1 nat over the reference, rejected lost 0.5: the margin is 0.1 x 1.5
    assert float(chosen) == pytest.approx(0.1) and float(rejected) == pytest.approx(-0.05)
    assert float(loss) == pytest.approx(math.log(1 + math.exp(-0.15)))
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), beta=0.0)


def test_token_nll_is_transformers_labels_loss(tiny_assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["policy"])
    model = AutoModelForCausalLM.from_pretrained(tiny_assets["policy"]).eval()
    examples = [demonstration({"prompt": p, "response": r}, tokenizer)
                for p, r in [("even 1 2 3 :", "2 4"), ("odd 5 5 5 :", "1 3 5 7 9")]]
    input_ids, attention_mask, loss_mask = padded(examples, 0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        labels = torch.where(loss_mask.bool(), input_ids, -100)
        theirs = float(model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss)
    nll, mask = token_nll(logits, input_ids, loss_mask)
    assert float((nll * mask).sum() / mask.sum()) == pytest.approx(theirs, rel=1e-6)
    assert sequence_logprobs(logits, input_ids, loss_mask).tolist() == pytest.approx(
        (-(nll * mask).sum(dim=1)).tolist())


# --------------------------------------------------------------------------- the data


def test_text_rows_end_with_eos_and_teach_only_the_response(tiny_assets):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["policy"])
    example = demonstration({"prompt": "even 1 2 3 :", "response": "2 4"}, tokenizer)
    prompt = tokenizer("even 1 2 3 :")["input_ids"]
    assert example.rows[0] == prompt + tokenizer("2 4", add_special_tokens=False)["input_ids"] + [2]
    assert example.loss_masks[0] == [0] * len(prompt) + [1, 1, 1]
    ranked = ranking({"prompt": "odd 1 :", "responses": ["1", "2", "3"], "ranking": [0, 2, 1]}, tokenizer)
    assert len(ranked.rows) == 3 and ranked.ranks == [0, 2, 1]
    assert ranking({"prompt": "odd 1 :", "chosen": "1", "rejected": "2"}, tokenizer).ranks == [0, 1]


def test_chat_rows_teach_the_assistant_turns_alone(tmp_path):
    tokenizer = chatml_tokenizer(str(tmp_path))
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is 17 plus 25?"},
                {"role": "assistant", "content": "The answer is 42."},
                {"role": "user", "content": "What is 17 plus 25?"},
                {"role": "assistant", "content": "42."}]
    example = demonstration({"messages": messages}, tokenizer)
    ids, mask = example.rows[0], example.loss_masks[0]
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
    taught = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert taught == "The answer is 42.<|im_end|>\n42.<|im_end|>\n"
    # a ranking of responses to a chat: each response is the template's assistant turn
    ranked = ranking({"messages": messages[:2], "chosen": "42.", "rejected": "41."}, tokenizer)
    assert tokenizer.decode([t for t, m in zip(ranked.rows[0], ranked.loss_masks[0]) if m]) == "42.<|im_end|>\n"


def test_bad_rows_are_named_with_key_file_and_row(tmp_path, tiny_assets):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["policy"])
    path = tmp_path / "rankings.jsonl"
    path.write_text(json.dumps({"prompt": "even 1 :", "chosen": "2", "rejected": "1"}) + "\n"
                    + json.dumps({"prompt": "even 1 :", "responses": ["2", "1"], "ranking": [0]}) + "\n")
    with pytest.raises(ConfigError, match=r'rm.data: .*rankings.jsonl line 2 has 1 ranks in "ranking" for 2 '):
        read_examples(str(path), "rm.data", tokenizer, "ranking", 64)
    path.write_text(json.dumps({"prompt": "even 1 :", "response": "2 " * 80}) + "\n")
    with pytest.raises(ConfigError, match=r"sft.data: none of the 1 rows .* fits in 16 tokens"):
        read_examples(str(path), "sft.data", tokenizer, "demonstration", 16)
    # the line an editor shows (blank lines count), and the key that is missing
    path.write_text("\n\n" + json.dumps({"prompt": "even 1 :", "answer": "2"}) + "\n")
    with pytest.raises(ConfigError, match=r'sft.data: .* line 3 has no "response" text \(its keys: prompt, answer\)'):
        read_examples(str(path), "sft.data", tokenizer, "demonstration", 64)
    chat = [{"role": "user", "content": "even 1 :"}, {"role": "assistant", "text": "2"}]
    path.write_text(json.dumps({"prompt": "odd 1 :", "response": "1"}) + "\n" + json.dumps({"messages": chat}) + "\n")
    with pytest.raises(ConfigError, match=r'line 2 has no "content" in "messages"\[1\] \(its keys: role, text\)'):
        read_examples(str(path), "sft.data", tokenizer, "demonstration", 64)
    # a chat for a tokenizer without a template names the stage's data and model keys, and the line
    path.write_text(json.dumps({"messages": chat[:1], "chosen": "2", "rejected": "1"}) + "\n")
    with pytest.raises(ConfigError, match=r"rm.data: .* line 1: a row is a chat .* the tokenizer of rm.model has no "):
        read_examples(str(path), "rm.data", tokenizer, "ranking", 64)


def test_a_stage_command_names_a_model_path_that_is_not_there(tmp_path):
    from typer.testing import CliRunner

    from launch.cli import app

    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    path = stage_config(tmp_path, "sft", {"model": str(tmp_path / "nonexistent"), "data": str(data)})
    result = CliRunner().invoke(app, ["sft", "-c", path])
    assert result.exit_code == ExitCode.CONFIG_ERROR and f"sft.model: {tmp_path / 'nonexistent'} does not exist" in result.output, \
        result.output


def test_stage_outputs_chain_into_the_next_stage_and_ppo():
    config = load_config(None, ["run_dir=/r", "sft.model=/base", "sft.data=/d.jsonl", "rm.data=/c.jsonl",
                                "dpo.data=/p.jsonl", "data.prompts=/q.jsonl"])
    assert (config.rm.model, config.dpo.model, config.dpo.reference) == ("/r/sft", "/r/sft", "/r/sft")
    assert (config.models.policy, config.models.reward) == ("/r/sft", "/r/rm")
    named = load_config(None, ["sft.model=/base", "sft.data=/d", "sft.output=/out", "rm.data=/c",
                               "rm.model=/other", "models.policy=/mine", "data.prompts=/q"])
    assert (named.rm.model, named.models.policy, named.models.reward) == ("/other", "/mine", "runs/default/rm")
    alone = load_config(None, ["rm.data=/c", "rm.model=/m"])
    with pytest.raises(ConfigError, match="models and data: missing, and tether run needs them"):
        alone.require_ppo("tether run")
    with pytest.raises(ConfigError, match="rm.model: the model rm trains from is not set"):
        load_config(None, ["rm.data=/c"])
    with pytest.raises(ConfigError, match="sft.batch_size: Input should be greater than or equal to 1"):
        load_config(None, ["sft.model=/m", "sft.data=/d", "sft.batch_size=0"])


# --------------------------------------------------------------------------- the commands, for real


def demonstrations(tmp_path, count: int, seed: int) -> str:
    from demos.parity import write_demonstrations

    path = tmp_path / f"demonstrations-{seed}.jsonl"
    write_demonstrations(str(path), count, seed)
    return str(path)


def stage_config(tmp_path, name: str, section: dict, file: str | None = None, **top) -> str:
    path = tmp_path / f"{file or name}.yaml"
    path.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), name: section, **top}))
    return str(path)


def marker(output) -> dict:
    with open(f"{output}/tether_stage.json") as file:
        return json.load(file)


def transformers_loss(model_dir: str, data: str) -> float:
    """The held-out loss as transformers computes it: ``labels`` (-100 off the response) over the
    whole held-out set in one batch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    examples, _ = read_examples(data, "sft.eval_data", tokenizer, "demonstration", 128)
    input_ids, attention_mask, loss_mask = padded(examples, 0)
    with torch.no_grad():
        return float(model(input_ids=input_ids, attention_mask=attention_mask,
                           labels=torch.where(loss_mask.bool(), input_ids, -100)).loss)


SFT = {"batch_size": 32, "lr": 3.0e-3, "max_len": 64, "lr_warmup_steps": 2}


@pytest.mark.slow
@pytest.mark.parametrize("setup", [{"zero_stage": 0}, {"zero_stage": 2}, {"lora_rank": 4, "lora_alpha": 8}],
                         ids=["zero0", "zero2", "lora"])
def test_sft_held_out_loss_is_transformers_loss_on_the_output(tmp_path, tiny_assets, setup):
    held_out = demonstrations(tmp_path, 64, 2)
    output = tmp_path / "sft"
    path = stage_config(tmp_path, "sft", {"model": tiny_assets["base"], "data": demonstrations(tmp_path, 320, 1),
                                          "eval_data": held_out, "output": str(output), **SFT, **setup})
    result = tether("sft", "-c", path)
    assert result.returncode == 0, result.stderr[-3000:]
    reported = marker(output)["held_out"]["loss"]
    assert reported == pytest.approx(transformers_loss(str(output), held_out), rel=1e-5)
    assert reported < transformers_loss(tiny_assets["base"], held_out) - 0.1  # it learned
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics" / "sft.jsonl")]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 11))  # 320 rows / 32
    assert (output / "adapter").is_dir() == ("lora_rank" in setup)  # LoRA: merged, the adapters beside
    again = tether("sft", "-c", path)  # the same recipe: not trained again
    assert again.returncode == 0 and "already holds this stage's model" in again.stderr


@pytest.mark.slow
def test_sft_on_two_ranks_matches_one(tmp_path, tiny_assets):
    """The same batches on 1 rank and on 2 (ZeRO-2, torch.distributed's launcher), micro-batches of
    4: the step's gradient is the batch's mean either way, so the held-out loss agrees."""
    data, held_out = demonstrations(tmp_path, 256, 1), demonstrations(tmp_path, 64, 2)
    losses = {}
    for ranks in (1, 2):
        output = tmp_path / f"sft-{ranks}"
        path = stage_config(tmp_path, "sft", {"model": tiny_assets["base"], "data": data, "eval_data": held_out,
                                              "output": str(output), "ranks": ranks, "zero_stage": 2,
                                              "micro_batch_size": 4, **SFT}, file=f"sft{ranks}")
        result = tether("sft", "-c", path)
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"ZeRO-2, {ranks} rank(s)" in result.stderr
        losses[ranks] = marker(output)["held_out"]["loss"]
    print(f"held-out loss: 1 rank {losses[1]:.7f}, 2 ranks {losses[2]:.7f}")
    assert losses[2] == pytest.approx(losses[1], abs=1e-5)
    assert losses[1] < transformers_loss(tiny_assets["base"], held_out) - 0.1  # both trained, alike


def test_ranking_scores_a_prompts_k_responses_in_one_forward_pass(tiny_assets):
    from transformers import AutoTokenizer

    from common.models import load_reward_model
    from stages.rm import ranking_sums, scores_of

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["policy"])
    model = load_reward_model(tiny_assets["policy"], "float32", tokenizer).eval()
    passes = []
    model.register_forward_hook(lambda module, args, kwargs, output: passes.append(len(kwargs["input_ids"])),
                                with_kwargs=True)
    rows = [{"prompt": "even 1 2 3 :", "responses": ["2 4", "1", "2 2 2 3", "8 6", "5"], "ranking": [0, 3, 1, 0, 2]},
            {"prompt": "odd 7 :", "chosen": "1 3", "rejected": "2"}]
    examples = [ranking(row, tokenizer) for row in rows]
    with torch.no_grad():
        loss, stats = ranking_sums(model, examples, 0)
        assert passes == [7]  # both prompts' 5 + 2 responses in one pass
        by_pair = []
        for example in examples:  # the same loss from one pass per pair
            pair_losses = []
            for i, j in itertools.permutations(range(len(example.rows)), 2):
                if example.ranks[i] < example.ranks[j]:
                    one = type(example)([example.rows[i], example.rows[j]],
                                        [example.loss_masks[i], example.loss_masks[j]], [0, 1])
                    winner, loser = scores_of(model, [one], 0).tolist()
                    pair_losses.append(pairwise_loss([winner, loser], [0, 1]))
            by_pair.append(sum(pair_losses) / len(pair_losses))
    assert len(passes) == 1 + 9 + 1
    assert float(loss) == pytest.approx(sum(by_pair), rel=1e-5)
    assert stats["pairs"] == 9 + 1 and stats["prompts"] == 2


@pytest.mark.slow
def test_rm_on_the_demos_comparisons_reaches_the_demos_accuracy(tmp_path):
    """The demo's reward model, built by `tether rm` at the demo's recipe (make demo)."""
    from demos.parity import build_assets

    paths = build_assets(tmp_path / "assets", log=lambda *_: None)
    held_out = marker(paths["reward"])["held_out"]
    assert held_out["accuracy"] >= 0.974, held_out
    from transformers import AutoConfig

    from scorer.scoring import REWARD_OFFSET_KEY

    config = AutoConfig.from_pretrained(paths["reward"])
    assert getattr(config, REWARD_OFFSET_KEY) == pytest.approx(held_out[REWARD_OFFSET_KEY])


@pytest.mark.slow
def test_rm_calibration_makes_the_training_responses_score_zero(tmp_path, tiny_assets):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from protocol.samples import Sample
    from scorer.scoring import reward_scores

    rows = [{"prompt": "even 1 2 3 :", "responses": ["2 4 6", "1 3", "2 5"], "ranking": [0, 2, 1]},
            {"prompt": "odd 7 7 7 :", "chosen": "1 3 5", "rejected": "2 4"}] * 16
    data = tmp_path / "rankings.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = tmp_path / "rm"
    path = stage_config(tmp_path, "rm", {"model": tiny_assets["policy"], "data": str(data), "output": str(output),
                                         "batch_size": 8, "lr": 1e-3, "eval_fraction": 0.0, "epochs": 4,
                                         "calibration": "normalize"})
    result = tether("rm", "-c", path)
    assert result.returncode == 0, result.stderr[-3000:]
    tokenizer = AutoTokenizer.from_pretrained(str(output))
    rm = AutoModelForSequenceClassification.from_pretrained(str(output), num_labels=1).eval()
    examples = [ranking(row, tokenizer) for row in rows]
    samples = [Sample(f"s{i}", i, 0, *(torch.tensor(part).numpy() for part in (row[:len(mask) - sum(mask)],
                                                                               row[len(mask) - sum(mask):])),
                      torch.zeros(sum(mask)).numpy(), "stop")
               for i, (row, mask) in enumerate((r, m) for e in examples for r, m in zip(e.rows, e.loss_masks))]
    scores = reward_scores(rm, samples, 0)  # the scorer's way, calibration applied
    assert float(scores.mean()) == pytest.approx(0.0, abs=1e-4)
    assert float(scores.std()) == pytest.approx(1.0, abs=1e-3)
    assert float(scores[0]) > float(scores[2]) > float(scores[1])  # what it learned of the first ranking


@pytest.mark.slow
def test_dpo_prefers_the_chosen_responses_it_trained_on(tmp_path, tiny_assets):
    import random

    from demos.parity import make_prompt

    rng = random.Random(0)
    rows = []
    for _ in range(192):
        prompt = make_prompt(rng)
        good, bad = ("0 2 4", "1 3 5") if prompt.startswith("even") else ("1 3 5", "0 2 4")
        rows.append({"prompt": prompt, "chosen": good, "rejected": bad})
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output = tmp_path / "dpo"
    path = stage_config(tmp_path, "dpo", {"model": tiny_assets["policy"], "data": str(data), "output": str(output),
                                          "batch_size": 16, "lr": 1e-3, "eval_fraction": 0.1, "beta": 0.1,
                                          "eval_every": 1})
    result = tether("dpo", "-c", path)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics" / "dpo.jsonl")]
    evaluations = [r for r in records if "eval_accuracy" in r]
    first, last = evaluations[0], evaluations[-1]
    assert last["eval_accuracy"] == 1.0 and last["eval_margin"] > first["eval_margin"] > 0
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # the policy starts as the reference
    assert marker(output)["held_out"]["accuracy"] == last["eval_accuracy"]


def rankings(path, prompts: int, seed: int, chats: bool = False) -> str:
    """Rankings of four made-up responses a prompt by the gold rule (a tie where gold is equal);
    with ``chats`` every other prompt is a one-message chat."""
    import random

    from demos.parity import gold_reward, make_prompt

    rng, vocabulary = random.Random(seed), ["<pad>", "<bos>", "<eos>", "even", "odd", ":"]
    with open(path, "w") as file:
        for _ in range(prompts):
            prompt = make_prompt(rng)
            responses = [" ".join(str(rng.randrange(10)) for _ in range(rng.randint(2, 5))) for _ in range(4)]
            prompt_ids = [1, vocabulary.index(prompt.split()[0])]
            golds = [gold_reward(prompt_ids, [len(vocabulary) + int(d) for d in r.split()]) for r in responses]
            order = sorted(set(golds), reverse=True)
            asked = ({"messages": [{"role": "user", "content": prompt}]} if chats and rng.random() < 0.5
                     else {"prompt": prompt})
            file.write(json.dumps({**asked, "responses": responses, "ranking": [order.index(g) for g in golds]}) + "\n")
    return str(path)


PLAIN_CHAT = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.mark.slow
def test_pipeline_chains_sft_rm_and_ppo_and_picks_up_where_it_stopped(tmp_path, tiny_assets):
    """The base model's chat template (transformers 5 writes it to chat_template.jinja) reaches every
    model the pipeline writes: rm trains on chat rows after sft, and PPO's policy renders a
    conversation to the ids the base renders it to."""
    from transformers import AutoTokenizer

    from common.runlog import read_metrics
    from tests.helpers import TWO_CORES

    base = tmp_path / "base"
    shutil.copytree(tiny_assets["base"], base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = PLAIN_CHAT  # an assistant turn that extends its prompt: rm's chat rows need one
    tokenizer.save_pretrained(base)
    assert (base / "chat_template.jinja").exists()
    run_dir = tmp_path / "run"
    config = {"run_dir": str(run_dir),
              "sft": {"model": str(base), "data": demonstrations(tmp_path, 256, 1), **SFT},
              "rm": {"data": rankings(tmp_path / "rankings.jsonl", 64, 3, chats=True), "batch_size": 16, "lr": 1e-3},
              "data": {"prompts": tiny_assets["prompts"]},
              "rollout": {"max_new_tokens": 6, "prompts_per_generate": 16, "max_model_len": 64},
              "learner": {"total_steps": 2, "batch_size": 16, "minibatch_size": 8, "ppo_epochs": 1},
              "transport": {"connect_retries": 60, "connect_interval_s": 0.5}, "placement": dict(TWO_CORES)}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    result = tether("pipeline", "-c", str(path), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ran = yaml.safe_load((run_dir / "config.yaml").read_text())  # what PPO ran on: the stages' outputs
    assert (ran["models"]["policy"], ran["models"]["reward"]) == (str(run_dir / "sft"), str(run_dir / "rm"))
    assert ran["rm"]["model"] == str(run_dir / "sft")
    assert [r["step"] for r in read_metrics(str(run_dir), "learner")] == [1, 2]
    stage_steps = {name: [r["step"] for r in read_metrics(str(run_dir), name) if "loss" in r] for name in ("sft", "rm")}
    assert stage_steps["sft"][-1] == 8 and stage_steps["rm"][-1] == 4  # 256 x 0.95 / 32; 64 x 0.95 / 16, cut
    assert (tmp_path / "run" / "logs" / "sft.log").read_text().count("sft step") >= 1
    conversation = [{"role": "user", "content": "even 1 2 3 :"}, {"role": "assistant", "content": "4 5"},
                    {"role": "user", "content": "odd 7 7 1 :"}]
    rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)["input_ids"]
    for written in (run_dir / "sft", run_dir / "rm", run_dir / "checkpoints" / "final"):
        again = AutoTokenizer.from_pretrained(written)
        assert again.chat_template == PLAIN_CHAT, written
        assert again.apply_chat_template(conversation, add_generation_prompt=True,
                                         tokenize=True)["input_ids"] == rendered, written

    again = tether("pipeline", "-c", str(path), timeout=600)  # everything done: nothing is trained again
    assert again.returncode == 0, again.stdout[-3000:]
    assert all(f"tether pipeline: {name} is done" in again.stdout for name in ("sft", "rm", "ppo")), again.stdout
    (run_dir / "rm" / "tether_stage.json").unlink()  # as if rm had not finished: it runs again, then PPO
    partial = tether("pipeline", "-c", str(path), timeout=600)
    assert partial.returncode == 0, partial.stdout[-3000:] + partial.stderr[-3000:]
    assert "tether pipeline: sft is done" in partial.stdout and "tether pipeline: rm -> " in partial.stdout
    assert "tether pipeline: ppo on " in partial.stdout and "ppo is done" not in partial.stdout
    assert [r["step"] for r in read_metrics(str(run_dir), "learner")] == [1, 2]  # a new PPO run, not appended


@pytest.mark.slow
def test_a_stopped_stage_goes_on_from_its_saved_state_to_the_same_model(tmp_path, tiny_assets):
    """SIGTERM mid-way: the stage saves its state and exits 128 + 15; the same command goes on from
    there and writes the model an uninterrupted run writes."""
    import signal
    import subprocess
    import sys

    from tests.helpers import REPO

    data = demonstrations(tmp_path, 2560, 1)
    section = {"model": tiny_assets["base"], "data": data, "eval_data": demonstrations(tmp_path, 64, 2), **SFT,
               "batch_size": 16, "checkpoint_every": 40}
    whole = stage_config(tmp_path, "sft", {**section, "output": str(tmp_path / "whole")}, file="whole")
    assert tether("sft", "-c", whole).returncode == 0
    path = stage_config(tmp_path, "sft", {**section, "output": str(tmp_path / "stopped")}, file="stopped")
    process = subprocess.Popen([sys.executable, "-m", "launch.cli", "sft", "-c", path], cwd=REPO,
                               stderr=subprocess.PIPE, text=True)
    for line in process.stderr:  # the first step's progress line: the loop runs, the signal is caught
        if "sft step 1/160" in line:
            process.send_signal(signal.SIGTERM)
            break
    rest = process.stderr.read()
    assert process.wait(timeout=120) == 128 + signal.SIGTERM, rest[-2000:]
    stopped_at = json.loads((tmp_path / "stopped.state" / "state.json").read_text())["step"]
    assert 1 <= stopped_at < 160 and "the same command goes on from there" in rest
    again = tether("sft", "-c", path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"going on from the state saved at step {stopped_at}" in again.stderr
    assert not (tmp_path / "stopped.state").exists()  # finished: its state is gone
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics" / "sft.jsonl")]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 161))  # each step once
    assert marker(tmp_path / "stopped")["held_out"]["loss"] == pytest.approx(
        marker(tmp_path / "whole")["held_out"]["loss"], abs=1e-6)
