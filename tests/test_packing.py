"""Packed and prefix-shared passes (``common.packing``): the layout against a brute-force reading
of what a tree is, and the segments (attention row by row) against the dense layout; on every
family the tests build, logprobs, entropies, values and their gradients of ``pack`` and ``tree``
(row by row, and in dense packed rows) equal to a padded pass within 1e-5 in float32; then a whole
PPO step's weights on real DeepSpeed engines, and the scorer's passes."""

import logging

import numpy as np
import pytest
import torch

from common.config import SamplingConfig
from common.distributions import entropy_from_logits, logprobs_from_logits
from common.models import ValueModel, disable_dropout
from common.packing import (bins, checked, for_model, layout, packed, packed_tokens, prefix_order, probe_mismatch,
                            prompt_units, refusal, segmented, segments_on)
from common.sequences import SequenceBatch, collate
from demos.parity import VOCAB as PARITY_VOCAB
from protocol.samples import Sample
from training.micro_batches import pass_shares

VOCAB = 40
TOLERANCE = 1e-5


def grouped_rows(seed=0, prompts=3, responses=3, vocab=VOCAB):
    """Token rows as a batch of groups makes them: ``prompts`` prompts of 4-9 tokens, each with
    ``responses`` responses of 1-7 tokens (two of them the same), and an episode's two parts (the
    second beginning with the whole first)."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(3, vocab, (n,), generator=generator).tolist()

    rows = []
    for _ in range(prompts):
        prompt = tokens(int(torch.randint(4, 10, (1,), generator=generator)))
        answers = [tokens(int(torch.randint(1, 8, (1,), generator=generator))) for _ in range(responses)]
        answers[-1] = list(answers[0])  # two responses alike: a row the tree holds no node of its own for
        rows += [(prompt, answer) for answer in answers]
    first = (tokens(5), tokens(4))
    rows += [first, (first[0] + first[1] + tokens(2), tokens(3))]  # an episode's parts
    return rows


def samples_of(rows, masked_environment=False):
    """``rows`` (prompt, response) as samples; ``masked_environment``: each response of 4 or more
    tokens has environment tokens at 1 and 2 (loss_mask 0), as an episode's turns do."""
    made = []
    for i, (prompt, response) in enumerate(rows):
        mask = None
        if masked_environment and len(response) >= 4:
            mask = np.ones(len(response), np.uint8)
            mask[1:3] = 0
        made.append(Sample(f"s{i}", i, 0, np.array(prompt, np.int32), np.array(response, np.int32),
                           np.zeros(len(response), np.float32), "stop", loss_mask=mask))
    return made


def test_a_trees_nodes_are_each_shared_prefix_once_and_attend_exactly_their_ancestors():
    rows = grouped_rows()
    batch = collate(samples_of(rows), 0)
    lay = layout(batch.input_ids, batch.lengths, "tree")
    sequences = [p + r for p, r in rows]
    # the distinct prefixes of all rows are the nodes, each once
    distinct = {tuple(seq[:j + 1]) for seq in sequences for j in range(len(seq))}
    assert len(lay.input_ids) == len(distinct) == packed_tokens(batch.input_ids, batch.lengths, "tree")
    path_of = {}  # each node's whole token path, read back through the rows
    for i, seq in enumerate(sequences):
        for j in range(len(seq)):
            node = int(lay.node[i, j])
            assert int(lay.input_ids[node]) == seq[j] and int(lay.position_ids[node]) == j
            assert path_of.setdefault(node, tuple(seq[:j + 1])) == tuple(seq[:j + 1])
    assert len(path_of) == len(distinct)
    # node a attends node b exactly when b's path begins a's
    brute = torch.tensor([[path_of[a][:len(path_of[b])] == path_of[b] for b in range(len(path_of))]
                          for a in range(len(path_of))])
    assert torch.equal(lay.allowed, brute)


def test_pack_lays_rows_one_after_another_each_attending_its_own_past():
    rows = grouped_rows(seed=1)
    batch = collate(samples_of(rows), 0)
    lay = layout(batch.input_ids, batch.lengths, "pack")
    lengths = [len(p) + len(r) for p, r in rows]
    assert len(lay.input_ids) == sum(lengths)
    blocks = torch.block_diag(*[torch.ones(n, n, dtype=torch.bool).tril() for n in lengths])
    assert torch.equal(lay.allowed, blocks)
    assert lay.position_ids.tolist() == [j for n in lengths for j in range(n)]


def test_packed_rows_hold_whole_rows_within_twice_the_longest_and_a_tree_keeps_a_prompts_rows_together():
    rows = grouped_rows(seed=5, prompts=4, responses=3)
    batch = collate(samples_of(rows), 0)
    prompts = batch.response_positions[:, 0] + 1
    capacity = 2 * int(batch.lengths.max())
    for packing in ("pack", "tree"):
        made = bins(batch.input_ids, batch.lengths, prompts, packing)
        assert sorted(torch.cat(made).tolist()) == list(range(len(rows)))  # every row once
        assert all(packed_tokens(batch.input_ids[b], batch.lengths[b], packing) <= capacity for b in made)
        if packing == "tree":  # each prompt's responses in one packed row
            assert all(any(set(range(3 * p, 3 * p + 3)) <= set(b.tolist()) for b in made) for p in range(4))
    run = packed(batch, "tree")
    packed_rows, width = run.input_ids.shape
    assert width <= capacity and run.attention_mask.shape == (packed_rows, 1, width, width)
    # the node that scores each response token holds the token before it, in whichever packed row
    flat = run.input_ids.flatten()
    for i, (prompt, response) in enumerate(rows):
        assert flat[run.response_positions[i, :len(response)]].tolist() == (prompt + response)[len(prompt) - 1:-1]


def test_segments_attend_what_the_dense_layout_allows_each_node_once_in_groups_of_like_rows():
    """A model on segment attention gets the rows' nodes as one sequence and each row's attention as
    its path: read back as node pairs, exactly the dense layout's mask; every node a query once."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(family_config("llama"))
    assert segmented(model) and model.config._attn_implementation == "tether_sdpa"
    batch = collate(samples_of(grouped_rows(seed=4, prompts=4, responses=3)), 0)
    for packing in ("pack", "tree"):
        lay = layout(batch.input_ids, batch.lengths, packing)
        run = packed(batch, packing, model)
        assert run.attention_mask is None and torch.equal(run.input_ids[0], lay.input_ids)
        assert torch.equal(run.position_ids[0], lay.position_ids)
        segments, nodes = run.segments, len(lay.input_ids)
        seen = torch.zeros((nodes, nodes), dtype=torch.bool)
        queried = []
        for queries, keys, allowed, slots in zip(segments.queries, segments.keys, segments.allowed, segments.slots):
            rows, width_q = queries.shape
            for slot in slots.tolist():
                g, q = divmod(slot, width_q)
                seen[queries[g, q], keys[g][allowed[g, 0, q]]] = True
                queried.append(int(queries[g, q]))
        assert torch.equal(seen, lay.allowed), packing
        assert sorted(queried) == list(range(nodes))  # each node's output computed once
        assert torch.equal(torch.tensor(queried)[segments.inverse], torch.arange(nodes))
        assert len(segments.queries) >= 2  # rows of unlike size in groups of their own
    # a pass laid out row by row runs on a model of segment attention only
    with pytest.raises(ValueError, match="segment attention"):
        for_model(packed(batch, "tree", model), AutoModelForCausalLM.from_config(family_config("llama")))


def test_a_pass_of_segments_makes_transformers_build_no_mask_of_its_nodes(monkeypatch):
    """With no cache (the learner's and the scorer's passes), transformers reads packed sequences from
    the position ids and would build an [N, N] mask that segment attention never reads; a padded
    pass on the same model still gets SDPA's mask."""
    import transformers.masking_utils
    from transformers import AutoModelForCausalLM

    built = []
    original = transformers.masking_utils.sdpa_mask
    monkeypatch.setattr(transformers.masking_utils, "sdpa_mask",
                        lambda *a, **kw: built.append(original(*a, **kw)) or built[-1])
    model = AutoModelForCausalLM.from_config(family_config("llama"))
    segmented(model)
    batch = collate(samples_of(grouped_rows()), 0)
    model(**packed(batch, "tree", model).model_inputs, use_cache=False)
    assert built == []
    model(**batch.model_inputs, use_cache=False)
    assert len(built) == 1 and built[0].shape[-1] == batch.input_ids.shape[1]


def test_an_actor_and_a_critic_of_unlike_attention_both_take_dense_masks(tmp_path, tiny_assets):
    """The learner lays a pass out once for both models: an actor on SDPA and a critic on eager (which
    keeps its family's own attention) both take the tree in dense masks, and the critic reads the
    actor's pass."""
    from common.config import load_config
    from learner.main import packing_taken
    from tests.helpers import base_config
    from transformers import AutoModel, AutoModelForCausalLM

    actor = AutoModelForCausalLM.from_config(family_config("llama"))
    eager = family_config("llama")
    eager._attn_implementation = "eager"
    critic = ValueModel(AutoModel.from_config(eager), torch.nn.Linear(64, 1))
    assert critic.config._attn_implementation == "eager"
    config = load_config(None, ["learner.packing=tree"], base=base_config(tmp_path, tiny_assets))
    engines = [type("Engine", (), {"module": model})() for model in (actor, critic)]
    assert packing_taken(config, engines, logging.getLogger("test")).learner.packing == "tree"
    assert not segments_on(actor) and not segments_on(critic)
    batch = collate(samples_of(grouped_rows()), 0)
    run = for_model(packed(batch, "tree", actor), critic)
    values = run.gather(critic(**run.model_inputs).logits.squeeze(-1))
    padded = batch.gather(critic(**batch.model_inputs).logits.squeeze(-1))
    mask = batch.response_mask.bool()
    assert (values[mask] - padded[mask]).abs().max() <= TOLERANCE


def test_pass_shares_and_the_prefix_order_read_what_a_tree_would_save():
    rows = grouped_rows(seed=2, prompts=2, responses=4)
    batch = collate(samples_of(rows), 0)
    measured = pass_shares(batch.input_ids, batch.lengths, None, None)  # one pass of all rows
    real = sum(len(p) + len(r) for p, r in rows)
    padded = len(rows) * max(len(p) + len(r) for p, r in rows)
    tree = len({tuple((p + r)[:j + 1]) for p, r in rows for j in range(len(p) + len(r))})
    assert measured["padding_share"] == pytest.approx(1 - real / padded)
    assert measured["prefix_share"] == pytest.approx(1 - tree / real)
    order, shared = prefix_order(batch.input_ids, batch.lengths)
    assert sorted(order.tolist()) == list(range(len(rows))) and int(shared[0]) == 0
    sequences = [p + r for p, r in rows]
    ordered = [sequences[i] for i in order.tolist()]
    assert ordered == sorted(sequences)
    # each prompt's responses share at least the prompt with the one before them; the episode's
    # second part begins with the whole first
    assert all(int(shared[k]) >= len(rows[i][0]) for k, i in enumerate(order.tolist())
               if k and rows[order[k - 1]][0] == rows[i][0])
    assert packed_tokens(batch.input_ids, batch.lengths, "tree") == int(batch.lengths.sum() - shared.sum())
    units = prompt_units(batch.input_ids, batch.lengths, batch.response_positions[:, 0] + 1)
    # each prompt's four responses one unit, the episode's two parts another, in the batch's order
    assert [sorted(unit.tolist()) for unit in units] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_the_minibatches_hold_a_prompts_rows_together_and_one_response_a_prompt_is_a_plain_shuffle():
    from learner.step import shuffled

    rows = grouped_rows(seed=4, prompts=4, responses=2)[:8]
    batch = collate(samples_of(rows), 0)
    units = prompt_units(batch.input_ids, batch.lengths, batch.response_positions[:, 0] + 1)
    order = shuffled(units, torch.Generator().manual_seed(7))
    assert sorted(order.tolist()) == list(range(8))
    assert all({int(a) // 2 for a in pair} == {int(pair[0]) // 2} for pair in order.split(2))  # a group side by side
    singles = [torch.tensor([i]) for i in range(8)]
    assert torch.equal(shuffled(singles, torch.Generator().manual_seed(7)),
                       torch.randperm(8, generator=torch.Generator().manual_seed(7)))


# --------------------------------------------------------------------------- every family


def family_config(family):
    import transformers

    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 max_position_embeddings=64)
    return {
        "llama": lambda: transformers.LlamaConfig(**small, **common),
        "qwen2": lambda: transformers.Qwen2Config(**small, num_key_value_heads=1, **common),
        "gpt_neox": lambda: transformers.GPTNeoXConfig(**small, **common),
        "gemma2": lambda: transformers.Gemma2Config(**small, num_key_value_heads=1, head_dim=32, sliding_window=64,
                                                    **common),
        "phi3": lambda: transformers.Phi3Config(**small, sliding_window=None, **common),
        "mistral": lambda: transformers.MistralConfig(**small, num_key_value_heads=1, sliding_window=None, **common),
        "opt": lambda: transformers.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=2,
                                              word_embed_proj_dim=64, max_position_embeddings=64, **common),
        "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=64, **common),
        "bloom": lambda: transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=2, **common),
    }[family]()


def passes(model, critic, batch: SequenceBatch, packing: str, laid_for=None):
    """Logprobs, entropies and values [B, T] of ``batch`` laid out as ``packing`` for ``laid_for``
    (a model on segment attention: row by row; None: dense packed rows), and the gradient of one
    loss of them all, per parameter, for actor and critic."""
    model.zero_grad()
    critic.zero_grad()
    sampling = SamplingConfig(temperature=0.7)
    run = packed(batch, packing, laid_for)
    logits = run.gather(model(**run.model_inputs, use_cache=False).logits)
    logprobs = logprobs_from_logits(logits, batch.response_tokens, sampling)
    entropies = entropy_from_logits(logits, sampling)
    values = run.gather(critic(**run.model_inputs).logits.squeeze(-1))
    mask = batch.response_mask
    # a loss of the scale PPO's are (means over tokens), whose gradients are then of order 1
    tokens = mask.sum()
    (((logprobs + 0.1 * entropies + values ** 2) * mask).sum() / tokens).backward()
    grads = {name: p.grad.clone() for name, p in [*model.named_parameters(), *critic.named_parameters()]
             if p.grad is not None}
    return logprobs * mask, entropies * mask, values * mask, grads


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox", "gemma2", "phi3", "mistral", "opt", "gpt2"])
@pytest.mark.parametrize("masked_environment", [False, True])
def test_packed_and_tree_passes_equal_a_padded_one_with_their_gradients(family, masked_environment):
    from transformers import AutoModel, AutoModelForCausalLM

    torch.manual_seed(0)
    config = family_config(family)
    model = disable_dropout(AutoModelForCausalLM.from_config(config))  # as the learner and scorer load them
    critic = disable_dropout(ValueModel(AutoModel.from_config(config), torch.nn.Linear(64, 1)))
    batch = collate(samples_of(grouped_rows(), masked_environment), 0)
    assert checked(model, "tree", 64, logging.getLogger("test"), "the actor") == "tree"
    assert segmented(model) and segmented(critic)  # each family takes attention row by row
    padded = passes(model, critic, batch, "none")
    for packing, laid_for in (("pack", model), ("tree", model), ("pack", None), ("tree", None)):
        if laid_for is None:
            assert len(packed(batch, packing).input_ids) > 1  # several packed rows, padded to the longest
        other = passes(model, critic, batch, packing, laid_for)
        for name, a, b in zip(("logprobs", "entropies", "values"), padded[:3], other[:3]):
            assert (a - b).abs().max() <= TOLERANCE, (packing, name)
        assert padded[3].keys() == other[3].keys()
        worst = max(float((padded[3][k] - other[3][k]).abs().max()) for k in padded[3])
        largest = max(float(padded[3][k].abs().max()) for k in padded[3])
        assert worst <= TOLERANCE and largest > 1e-2, (packing, "gradients", worst, largest)
    assert float(batch.response_mask.sum()) < batch.response_mask.numel()  # padding (and masks) were there to skip


@pytest.mark.parametrize("packing", ["pack", "tree"])
def test_the_start_up_probe_packs_rows_together_so_that_a_mask_ignored_shows(packing, monkeypatch):
    """The probe's rows share packed rows (else a family that ignored the mask would pass it), and a
    family whose rows see each other's tokens is caught: here what steers a packed pass (the
    segments, then the 4-D mask and the positions too) is dropped before the model. Without
    segments the dense masks are taken; without either, none."""
    import common.packing as packing_module
    from transformers import AutoModelForCausalLM

    made = []
    original = packing_module.bins
    monkeypatch.setattr(packing_module, "bins", lambda *a: made.append(original(*a)) or made[-1])
    model = disable_dropout(AutoModelForCausalLM.from_config(family_config("llama")))
    assert probe_mismatch(model, packing) < 1e-5
    assert max(len(group) for group in made[-1]) >= 2
    segmented(model)
    assert probe_mismatch(model, packing) < 1e-5
    forward = model.model.forward
    monkeypatch.setattr(model.model, "forward", lambda **kw: forward(**{
        key: value for key, value in kw.items() if key != "segments"}))
    assert probe_mismatch(model, packing) > 1e-2
    assert checked(model, packing, 64, logging.getLogger("test"), "the actor") == packing  # dense masks
    assert model.config._attn_implementation == "sdpa"
    monkeypatch.setattr(model.model, "forward", lambda **kw: forward(**{  # nor positions: rows see each other
        **{key: value for key, value in kw.items() if key not in ("segments", "position_ids")},
        "attention_mask": None if kw["attention_mask"] is not None and kw["attention_mask"].dim() == 4
        else kw["attention_mask"]}))
    assert probe_mismatch(model, packing) > 1e-2
    assert checked(model, packing, 64, logging.getLogger("test"), "the actor") == "none"
    assert model.config._attn_implementation == "sdpa"


def test_a_family_a_4d_mask_cannot_steer_falls_back_to_none_with_a_line(caplog):
    from transformers import AutoModelForCausalLM

    bloom = AutoModelForCausalLM.from_config(family_config("bloom"))
    with caplog.at_level(logging.WARNING):
        assert checked(bloom, "tree", 64, logging.getLogger("test"), "the actor") == "none"
    assert "packing tree is off for the actor (none): bloom computes its ALiBi positions" in caplog.text
    mistral = family_config("mistral")
    mistral.sliding_window = 16
    assert "sliding window of 16 tokens" in refusal(mistral, 64)
    assert refusal(mistral, 16) is None  # no sequence passes the window: the mask is the window's


def test_dropout_is_off_where_a_family_keeps_its_rate_as_a_float_of_the_layer():
    """OPT calls functional dropout with ``self.dropout = config.dropout``: no nn.Dropout holds it, and
    a model in train mode (the learner's) gave two passes that differed."""
    from transformers import AutoModelForCausalLM

    model = disable_dropout(AutoModelForCausalLM.from_config(family_config("opt"))).train()
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    assert torch.equal(model(ids).logits, model(ids).logits)


# --------------------------------------------------------------------------- a whole step, on DeepSpeed


@pytest.fixture(scope="module")
def grouped_samples(samples):
    """The learner tests' samples, the two responses to each prompt side by side (a group of 2)."""
    import copy

    by_prompt = {}
    for sample in samples:
        by_prompt.setdefault(tuple(sample.prompt_tokens.tolist()), []).append(copy.copy(sample))
    for index, group in enumerate(by_prompt.values()):
        for sample in group:
            sample.prompt_index = index
    return [sample for group in by_prompt.values() for sample in group]


@pytest.mark.parametrize("options", [
    ["learner.zero_stage=0"],
    ["learner.zero_stage=3", "learner.micro_batch_size=3"],
    # GRPO as its paper has it, the KL a loss term: a group's advantages are its scores' alone (with the
    # KL in the reward, a group whose scores differ by 1e-4 divides float noise by their spread)
    ["learner.zero_stage=0", "learner.advantage_estimator=grpo", "rollout.samples_per_prompt=2", "learner.kl_in=loss",
     "learner.minibatch_size=4", "learner.ppo_epochs=2"],
    # the checkpointed layers computed again in the backward, with the pass's segments
    ["learner.zero_stage=0", "learner.gradient_checkpointing=true"],
], ids=["zero0", "zero3-micro-batches", "grpo-minibatches", "checkpointed"])
def test_a_ppo_step_trains_the_same_weights_packed_and_as_a_tree_as_padded(tmp_path, tiny_assets, grouped_samples,
                                                                            options, restore_environment):
    from tests.test_learner import one_step

    assert len({tuple(s.prompt_tokens.tolist()) for s in grouped_samples}) < len(grouped_samples)  # prompts shared
    # lr 1e-4: Adam's first steps move every weight whose gradient is not 0 by about lr, whatever the
    # gradient's size, so float noise on a gradient near 0 shows as a share of lr (1.3% at 1e-3)
    options = ["learner.actor_lr=1e-4", "learner.critic_lr=1e-4", *options]
    padded, padded_weights, actor = one_step(tmp_path, tiny_assets, grouped_samples, *options)
    moved = max(float((padded_weights[name] - tensor).abs().max()) for name, tensor in _initial(tiny_assets).items()
                if name in padded_weights)
    assert moved > 5 * TOLERANCE  # the step changed the weights: the agreement means something
    for packing in ("pack", "tree"):
        stats, weights, packed_actor = one_step(tmp_path, tiny_assets, grouped_samples, *options,
                                                f"learner.packing={packing}")
        assert packed_actor.module.config._attn_implementation == "tether_sdpa"  # attention row by row
        gap = max(float((weights[name] - padded_weights[name]).abs().max()) for name in padded_weights)
        worst = sorted(((float((weights[n] - padded_weights[n]).abs().max()), n) for n in padded_weights))[-3:]
        assert gap <= TOLERANCE, (packing, gap, worst)
        for name in ("policy_loss", "value_loss", "entropy", "kl"):
            if name in padded:
                assert stats[name] == pytest.approx(padded[name], abs=TOLERANCE), (packing, name)


def _initial(assets) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(assets["policy"]).state_dict()


# --------------------------------------------------------------------------- the scorer's passes


def test_the_scorers_reference_and_reward_passes_packed_equal_padded(tiny_assets):
    """The reference's logprobs and the reward model's scores of groups and episodes: one padded pass
    against packed and tree passes cut at 24 tokens (several passes, a row longer than that alone)."""
    from transformers import AutoModelForCausalLM

    from common.models import load_reward_model
    from scorer.scoring import reference_logprobs, reward_scores

    reference = AutoModelForCausalLM.from_pretrained(tiny_assets["policy"]).eval()
    rm = load_reward_model(tiny_assets["reward"], "float32", None, new_head=False).eval()
    made = samples_of(grouped_rows(seed=3, vocab=len(PARITY_VOCAB)), masked_environment=True)
    sampling = SamplingConfig(temperature=0.7)
    padded = reference_logprobs(reference, made, 0, sampling)
    scores = reward_scores(rm, made, 0)
    assert len(made) * max(len(s.prompt_tokens) + len(s.response_tokens) for s in made) > 24
    for rows_by_rows in (True, False):  # segment attention, as the scorer's check gives it, and dense masks
        for model, what in ((reference, "the reference"), (rm, "the reward model")):
            assert checked(model, "tree", 64, logging.getLogger("test"), what) == "tree"
            segmented(model, rows_by_rows)
        for packing in ("pack", "tree"):
            other = reference_logprobs(reference, made, 0, sampling, packing=packing, max_tokens=24)
            assert all(a.shape == b.shape and (a - b).abs().max() <= TOLERANCE
                       for a, b in zip(padded, other)), packing
            torch.testing.assert_close(reward_scores(rm, made, 0, packing=packing, max_tokens=24), scores,
                                       atol=TOLERANCE, rtol=0)
