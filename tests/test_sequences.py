"""How samples become model inputs (common.sequences): an episode's environment tokens are inputs
but not trained on."""

import numpy as np
import torch

from common.sequences import collate
from tests.helpers import sample_of


def test_an_episode_is_one_sequence_whose_mask_holds_the_policys_tokens_only():
    episode = sample_of([1, 2], [3, 4, 5, 6, 7])
    episode.loss_mask = np.array([1, 0, 0, 1, 0], np.uint8)  # turn, observation, turn, observation
    batch = collate([episode, sample_of([1], [3, 4])], pad_token_id=0)
    assert batch.input_ids[0].tolist() == [1, 2, 3, 4, 5, 6, 7]  # the model reads every token
    assert batch.response_mask.tolist() == [[1, 0, 0, 1, 0], [1, 1, 0, 0, 0]]
    # selecting keeps the columns up to each row's last policy token, holes and all
    part = batch.select(torch.tensor([0]))
    assert part.response_mask.tolist() == [[1, 0, 0, 1]] and part.response_tokens.tolist() == [[3, 4, 5, 6]]
    assert batch.select(torch.tensor([1])).response_mask.tolist() == [[1, 1]]
