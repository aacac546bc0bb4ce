"""Reward calls in the scorer: async functions run at once up to scorer.reward_concurrency, each
with a deadline; a reward service over HTTP (a real server the test starts); what a failure costs
(0, or the group under drop_group); rewards per turn on each turn's last policy token."""

import asyncio
import json
import logging
import socket
import threading
import time

import numpy as np
import pytest

from protocol.samples import Sample
from tests.test_scorer import make_scorer

ROWS = [{"prompt": "even 1 2 :", "answer": "2"}, {"prompt": "odd 0 0 :", "answer": "1"}]
PAIRS = [([1, 3, 7, 8, 5], [8, 10, 12, 6, 2]), ([1, 4, 6, 6, 5], [9, 8, 2]), ([1, 3, 7, 8, 5], [9, 2]),
         ([1, 4, 6, 6, 5], [8, 8, 12, 2])]


def four_samples():
    return [Sample(f"s{i}", i // 2, 0, np.array(p, np.int32), np.array(r, np.int32), np.zeros(len(r), np.float32),
                   "stop", data_row=i % 2) for i, (p, r) in enumerate(PAIRS)]


RUNNING = {"now": 0, "most": 0}


async def counted_length(response_tokens):
    """Its value is the response's length; a response of 2 tokens never answers (past any deadline)."""
    RUNNING["now"] += 1
    RUNNING["most"] = max(RUNNING["most"], RUNNING["now"])
    try:
        await asyncio.sleep(0.2 if len(response_tokens) != 2 else 3600)
        return float(len(response_tokens))
    finally:
        RUNNING["now"] -= 1


def hangs_on_short(response_tokens):
    if len(response_tokens) == 2:
        time.sleep(3.0)
    return 1.0


def fails_on_short(response_tokens):
    if len(response_tokens) == 2:
        raise KeyError("no answer")
    return 1.0


def exits_on_short(response_tokens):
    if len(response_tokens) == 2:
        raise SystemExit(3)
    return 1.0


async def huge_on_long(response_tokens):
    return 10 ** 400 if len(response_tokens) == 5 else 1.0


def test_a_reward_that_exits_or_answers_past_a_float_fails_its_sample_and_the_scorer_goes_on(tmp_path, tiny_assets):
    scorer = make_scorer(tmp_path, tiny_assets, prompts_rows=ROWS, models={"reward": None}, scorer={
        "reward_functions": [{"function": "tests.test_reward_calls:exits_on_short"},
                             {"function": "tests.test_reward_calls:huge_on_long"}]})
    for _ in range(2):  # and again: its event loop still runs
        samples = four_samples()
        parts = scorer.score(samples)
        assert [s.reward for s in samples] == [1.0, 2.0, 1.0, 2.0]
        assert parts["reward_failed:tests.test_reward_calls:exits_on_short:UserExit"] == 1
        assert parts["reward_failed:tests.test_reward_calls:huge_on_long:NotANumber"] == 1
    scorer.close()


def test_async_reward_functions_run_together_up_to_the_limit_and_one_past_its_deadline_counts_0(
        tmp_path, tiny_assets, caplog):
    RUNNING.update(now=0, most=0)
    scorer = make_scorer(tmp_path, tiny_assets, prompts_rows=ROWS, models={"reward": None}, scorer={
        "reward_functions": [{"function": "tests.test_reward_calls:counted_length"},
                             {"function": "tests.test_reward_calls:hangs_on_short", "weight": 10.0}],
        "reward_concurrency": 3, "reward_deadline_s": 1.0})
    samples = four_samples()
    with caplog.at_level(logging.WARNING):
        parts = scorer.score(samples)
    scorer.close()
    assert RUNNING["most"] == 3  # four async calls, three at a time
    # the 2-token response: its async call and its plain one both passed their deadline
    assert [s.reward for s in samples] == [5.0 + 10, 3.0 + 10, 0.0, 4.0 + 10]
    assert parts["reward_failed"] == 2
    assert parts["reward_failed:tests.test_reward_calls:counted_length:TimeoutError"] == 1
    assert parts["reward_failed:tests.test_reward_calls:hangs_on_short:TimeoutError"] == 1
    assert parts["tests.test_reward_calls:counted_length"] == pytest.approx((5 + 3 + 0 + 4) / 4)
    assert "reward tests.test_reward_calls:counted_length failed on sample s2" in caplog.text
    assert all(s.drop_reason is None for s in samples)  # zero: nothing is dropped


def test_under_drop_group_a_failed_call_marks_its_sample_and_the_traceback_is_logged_once(
        tmp_path, tiny_assets, caplog):
    scorer = make_scorer(tmp_path, tiny_assets, prompts_rows=ROWS, models={"reward": None}, scorer={
        "reward_functions": [{"function": "tests.test_reward_calls:fails_on_short"}],
        "on_reward_failure": "drop_group"})
    samples = four_samples()
    with caplog.at_level(logging.WARNING):
        parts = scorer.score(samples)
        scorer.score(four_samples())
    scorer.close()
    assert [s.drop_reason for s in samples] == ["", "", "reward_failed", ""]
    assert parts["reward_failed:tests.test_reward_calls:fails_on_short:KeyError"] == 1
    assert caplog.text.count("reward tests.test_reward_calls:fails_on_short failed") == 1
    assert "Traceback" in caplog.text and "no answer" in caplog.text


# --------------------------------------------------------------------------- a reward service


class Service:
    """A reward service on a real socket: FastAPI under uvicorn, in a thread of the test."""

    def __init__(self):
        import uvicorn
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse

        app, self.bodies, self.calls = FastAPI(), [], {"flaky": 0}

        @app.post("/length")
        async def length(request: Request):
            body = json.loads(await request.body())
            self.bodies.append(body)
            return {"rewards": [len(item["response"]) for item in body["samples"]]}

        @app.post("/flaky")  # 500 twice, then answers
        async def flaky(request: Request):
            self.calls["flaky"] += 1
            if self.calls["flaky"] <= 2:
                return JSONResponse({"error": "warming up"}, status_code=500)
            return await length(request)

        @app.post("/broken")
        async def broken():
            return JSONResponse({"error": "down"}, status_code=503)

        @app.post("/hangs")
        async def hangs():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:  # the server's shutdown
                return {"rewards": []}

        @app.post("/short")
        async def short(request: Request):
            body = json.loads(await request.body())
            return {"rewards": [1.0] * (len(body["samples"]) - 1)}

        @app.post("/refuses")
        async def refuses():
            return JSONResponse({"error": "no"}, status_code=422)

        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the reward service did not start"
            time.sleep(0.02)

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def service():
    service = Service()
    yield service
    service.close()


def remote_scorer(tmp_path, tiny_assets, url, **scorer):
    return make_scorer(tmp_path, tiny_assets, prompts_rows=ROWS, models={"reward": None},
                       scorer={"reward_url": url, "reward_url_weight": 0.5, "reward_deadline_s": 2.0, **scorer})


def test_a_reward_service_is_posted_the_samples_in_openrlhfs_shape_and_its_rewards_are_trained_on(
        service, tmp_path, tiny_assets):
    scorer = remote_scorer(tmp_path, tiny_assets, service.url + "/length")
    samples = four_samples()
    parts = scorer.score(samples)
    texts = [scorer.tokenizer.decode(r, skip_special_tokens=True) for _, r in PAIRS]
    assert [s.reward for s in samples] == pytest.approx([0.5 * len(text) for text in texts])
    assert parts["reward_failed"] == 0 and parts["reward_url"] == pytest.approx(np.mean([len(t) for t in texts]))
    body = service.bodies[-1]
    assert [item["response"] for item in body["samples"]] == texts and body["samples"][1]["row"] == ROWS[1]
    assert body["labels"] == ["2", "1", "2", "1"] and len(body["query"]) == len(body["prompts"]) == 4
    assert body["query"][0] == scorer.tokenizer.decode(PAIRS[0][0] + PAIRS[0][1], skip_special_tokens=True)
    scorer.close()


@pytest.mark.parametrize("route, error", [("/flaky", None), ("/broken", "TimeoutError"), ("/hangs", "TimeoutError"),
                                          ("/short", "WrongCount"), ("/refuses", "HTTPStatusError"),
                                          (":1/nothing-listens", "TimeoutError")])
def test_a_reward_service_that_fails_costs_its_samples_0_and_the_scorer_serves_on(
        service, tmp_path, tiny_assets, route, error):
    url = "http://127.0.0.1:1/nothing-listens" if route.startswith(":1") else service.url + route
    scorer = remote_scorer(tmp_path, tiny_assets, url)
    samples = four_samples()
    parts = scorer.score(samples)
    if error is None:  # 500 twice: tried again, backing off, within the deadline
        assert all(s.reward > 0 for s in samples) and parts["reward_failed"] == 0
    else:
        assert [s.reward for s in samples] == [0.0] * 4 and parts["reward_failed"] == 4
        assert parts[f"reward_failed:reward_url:{error}"] == 4
    assert scorer.score(four_samples())["reward_failed"] == (0 if error is None else 4)  # and it goes on
    scorer.close()


# --------------------------------------------------------------------------- rewards per turn


def turn_text(response):
    return float(len(response.split()))


outcome_words = turn_text  # the same count, of the whole response


def conversation_length(messages):
    return float(len(messages))


def test_a_per_turn_function_scores_each_turn_on_its_last_policy_token_given_the_conversation_so_far(
        tmp_path, tiny_assets):
    """An episode of three turns (policy tokens where the mask is 1, an observation between): each
    turn's reward lands on its own last policy token, computed on that turn and the conversation up
    to it; a whole-episode function still scores the outcome."""
    scorer = make_scorer(tmp_path, tiny_assets, prompts_rows=ROWS, models={"reward": None}, scorer={
        "reward_functions": [{"function": "tests.test_reward_calls:turn_text", "per_turn": True, "weight": 2.0},
                             {"function": "tests.test_reward_calls:conversation_length", "per_turn": True,
                              "weight": 100.0},
                             {"function": "tests.test_reward_calls:outcome_words"}]})
    response = [8, 10, 7, 7, 12, 6, 2, 7, 9]
    mask = np.array([1, 1, 0, 0, 1, 1, 1, 0, 1], np.uint8)
    messages = [{"role": "user", "content": "even 1 2 :"}, {"role": "assistant", "content": "2 4"},
                {"role": "user", "content": "1 1"}, {"role": "assistant", "content": "6 0"},
                {"role": "user", "content": "1"}, {"role": "assistant", "content": "3"}]
    episode = Sample("e0", 0, 0, np.array([1, 3, 7, 8, 5], np.int32), np.array(response, np.int32),
                     np.zeros(9, np.float32), "stop", data_row=0, loss_mask=mask,
                     turn_rewards=np.zeros(9, np.float32), messages=json.dumps(messages))
    single = four_samples()[1]
    scorer.score([episode, single])
    scorer.close()
    turns = [scorer.tokenizer.decode(response[a:b], skip_special_tokens=True) for a, b in ((0, 2), (4, 7), (8, 9))]
    expected = np.zeros(9, np.float32)
    for end, text, spoken in zip((1, 6, 8), turns, (2, 4, 6)):  # the conversation up to the turn: 2, 4, 6 messages
        expected[end] = 2.0 * len(text.split()) + 100.0 * spoken
    np.testing.assert_allclose(episode.turn_rewards, expected)
    assert (episode.turn_rewards[mask == 0] == 0).all()
    whole = scorer.tokenizer.decode(response, skip_special_tokens=True)
    assert episode.reward == float(len(whole.split()))  # the outcome function: the whole response
    # a single response is one turn: its reward on its last token; the outcome's is its reward
    text = scorer.tokenizer.decode(PAIRS[1][1], skip_special_tokens=True)
    assert single.turn_rewards.tolist() == [0.0, 0.0, 2.0 * len(text.split())]  # messages None: 100 x 0 failed


# --------------------------------------------------------------------------- requests in flight


class HeldClient:
    """The buffer's side of a scorer's requests, answered when the test says (a fake of the
    transport alone: the loop's order of asking, taking and sending is what is tested)."""

    def __init__(self):
        self.sent, self.answers, self.counters = [], {}, {}

    def send(self, msg_type, fields=None, tensors=None):
        self.sent.append((msg_type, fields, tensors))
        return len(self.sent)

    def reply_to(self, request_id, msg_type, wait_s):
        return self.answers.pop(request_id, None)

    def wait(self, request_id, waiting_for=None):
        return self.answers.pop(request_id)

    def request(self, msg_type, fields=None, tensors=None):
        self.send(msg_type, fields, tensors)

    def work(self, request_id, samples=None):
        from protocol.message import Message
        from protocol.samples import pack_samples

        fields, tensors = pack_samples(samples or [])
        self.answers[request_id] = Message("score_work", {**fields, "stop": not samples}, tensors)


class SlowScorer:
    """A scorer whose jobs finish when the test says: a slow judge's or reward call's."""

    busy = False
    log = logging.getLogger("test")

    def begin(self, samples):
        job = type("Job", (), {"samples": samples, "done": False})()
        self.jobs = [*getattr(self, "jobs", []), job]
        return job

    def finish(self, job):
        for sample in job.samples:
            sample.ref_logprobs, sample.reward = np.zeros(len(sample.response_tokens), np.float32), 1.0
        return {"reward_failed": 0}


def test_a_scorer_asks_for_more_while_a_request_is_under_way_and_sends_each_as_it_finishes():
    from common.config import ScorerConfig
    from scorer.main import Work

    client, scorer, written = HeldClient(), SlowScorer(), []
    work = Work(client, scorer, type("Metrics", (), {"write": lambda self, record: written.append(record)})(),
                ScorerConfig(requests_in_flight=2))
    first, second = four_samples()[:2], four_samples()[2:]
    work.ask()
    client.work(1, first)
    work.take()
    work.ask()  # the first is under way: the second request goes out now
    assert [m for m, _, _ in client.sent] == ["score_request", "score_request"]
    client.work(2, second)
    work.take()
    work.ask()  # two under way: no third
    assert len(client.sent) == 2 and len(work.jobs) == 2
    scorer.jobs[1].done = True  # the later one finishes first and goes first
    work.send_done()
    assert client.sent[2][0] == "scored" and client.sent[2][1]["sample_ids"] == ["s2", "s3"]
    scorer.jobs[0].done = True
    work.send_done()
    assert client.sent[-1][1]["sample_ids"] == ["s0", "s1"] and not work.jobs and work.scored_total == 4
    assert [record["scored"] for record in written] == [2, 2] and written[-1]["in_flight"] == 0
    work.ask()
    client.work(len(client.sent), four_samples()[:1])
    work.take()
    work.ask()
    assert client.sent[-1][0] == "score_request"
    client.work(len(client.sent))  # the run is over: what is still being scored would never be trained
    work.take()
    assert work.stopping and not work.jobs and [m for m, _, _ in client.sent].count("scored") == 2
