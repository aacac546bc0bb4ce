"""What a user reads of a run: `tether status`, `tether plot`, the console line and the logs."""

import json

import pytest
from typer.testing import CliRunner

from launch.cli import app
from launch.exit_codes import ExitCode


def write_metrics(run_dir, role: str, records: list[dict]) -> None:
    (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics" / f"{role}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_episodes_and_dynamic_sampling_panels_are_drawn_only_for_a_run_with_them(tmp_path):
    from launch.report import PANELS, plot_run

    learner = [{"step": s, "reward": 0.1 * s, "kl": 0.01, "response_length": 4.0} for s in (1, 2)]
    single, episodes = tmp_path / "single", tmp_path / "episodes"
    for run_dir in (single, episodes):
        write_metrics(run_dir, "learner", learner)
    write_metrics(single, "rollout0", [{"step": 1, "tokens_per_s": 100.0}])
    write_metrics(episodes, "rollout0", [{"step": 1, "tokens_per_s": 100.0, "turns_per_episode": 2.5}])
    write_metrics(episodes, "buffer", [{"step": 1, "groups_filtered": 3, "groups_unfiltered": 0}])
    every = [title for title, _ in PANELS]
    assert plot_run(str(single))[1] == [title for title in every if title not in ("episodes", "dynamic sampling")]
    assert plot_run(str(episodes))[1] == every


def test_the_judges_panel_draws_each_judges_score_and_the_scorers_failures(tmp_path):
    from launch.report import SCORING, panels_of, plot_run

    write_metrics(tmp_path, "learner", [{"step": s, "reward": 0.1 * s} for s in (1, 2)])
    scorer = [{"policy_version": v, "judge:rubric": 0.5 + 0.1 * v, "judge_unparsed": v, "judge_unparsed:rubric": v,
               "reward_failed": 0} for v in (0, 1, 2)]
    write_metrics(tmp_path, "scorer0", scorer)
    assert plot_run(str(tmp_path))[1][-1] == SCORING
    panel = dict(panels_of({"scorer0": scorer}))[SCORING]
    assert [key for _, key, _ in panel] == ["judge:rubric", "judge_unparsed", "reward_failed"]
    # no judge, no failure: no panel; a failed reward call draws it
    assert SCORING not in dict(panels_of({"scorer0": [{"policy_version": 0, "reward_failed": 0}]}))
    assert SCORING in dict(panels_of({"scorer0": [{"policy_version": 0, "reward_failed": 3}]}))


def test_metrics_read_while_a_role_appends_are_its_whole_lines(tmp_path):
    """`tether run` reads the learner's metrics while the learner appends them: a line caught half
    written is left for the next read, which has it whole."""
    from common.runlog import MetricsWriter, read_metrics

    writer = MetricsWriter(str(tmp_path), "learner", tensorboard=False)
    writer.write({"step": 1, "reward": 0.5})
    whole = (tmp_path / "metrics" / "learner.jsonl").read_text()
    line = json.dumps({"time": 1.0, "step": 2, "reward": 0.75}) + "\n"
    with open(tmp_path / "metrics" / "learner.jsonl", "a") as file:
        file.write(line[:20])  # a read now sees the first 20 characters of step 2
        file.flush()
        assert [record["step"] for record in read_metrics(str(tmp_path), "learner")] == [1]
        file.write(line[20:])
    assert [record["step"] for record in read_metrics(str(tmp_path), "learner")] == [1, 2]
    assert whole.endswith("\n")
    writer.close()


def test_status_of_a_directory_that_is_not_a_run_is_an_error(tmp_path):
    result = CliRunner().invoke(app, ["status", str(tmp_path / "nowhere"), "--once"])
    assert result.exit_code == ExitCode.CONFIG_ERROR and "is not a tether run directory" in result.output, result.output
    result = CliRunner().invoke(app, ["status", str(tmp_path), "--once"])  # a directory, but no run in it
    assert result.exit_code == ExitCode.CONFIG_ERROR


def test_the_console_progress_line_shows_the_bound_and_why_it_moved():
    from launch.runner import _progress_line

    record = {"step": 7, "reward": 0.5, "kl": 0.01, "response_length": 4.0, "samples_per_s": 90.0, "staleness": 0.8,
              "max_staleness": 2, "staleness_change": "2 -> 4: 4 healthy steps"}
    assert _progress_line(record, 40).endswith("staleness 0.80 (k 2) | k changed: 2 -> 4: 4 healthy steps")
    del record["staleness_change"]
    assert _progress_line(record, 40).endswith("staleness 0.80 (k 2)")
    assert "teacher kl" not in _progress_line(record, 40)
    assert "| kl 0.0100 | teacher kl 0.2500 | len 4.0 |" in _progress_line({**record, "teacher_kl": 0.25}, 40)


def test_vllms_warnings_that_say_nothing_wrong_are_dropped_and_colour_codes_stripped():
    import logging

    from common.runlog import PlainText
    from rollout.worker_extension import ExpectedWarnings

    def record(message, *args, level=logging.WARNING):
        return logging.LogRecord("vllm.x", level, __file__, 1, message, args, None)

    expected = ExpectedWarnings()
    assert not expected.filter(record("%s: Failed to load weights", "RotaryEmbedding"))  # as vLLM logs it
    assert not expected.filter(record("CPU backend doesn't allow to use `torch.set_num_threads` after the thread "
                                      "binding, skip it."))
    assert expected.filter(record("%s: Failed to load weights", "QKVParallelLinear"))  # a real failure stays
    assert expected.filter(record("RotaryEmbedding: Failed to load weights", level=logging.ERROR))
    report = record("\x1b[1mLlamaForSequenceClassification LOAD REPORT\x1b[0m from: /m")
    assert PlainText().filter(report) and report.getMessage() == "LlamaForSequenceClassification LOAD REPORT from: /m"


def test_plan_of_a_directory_that_is_not_a_finished_run_is_one_line_and_exit_2(tmp_path):
    for run_dir in (tmp_path / "nowhere", tmp_path):
        result = CliRunner().invoke(app, ["plan", str(run_dir), "--devices", "2"])
        assert result.exit_code == ExitCode.CONFIG_ERROR, result.output
        assert result.output == f"error: {run_dir} is not a finished tether run: it holds no config.yaml\n"
    (tmp_path / "config.yaml").write_text("placement: {mode: split}\n")  # started, but no step trained
    result = CliRunner().invoke(app, ["plan", str(tmp_path), "--devices", "2"])
    assert result.exit_code == ExitCode.CONFIG_ERROR and result.output.count("\n") == 1
    assert "learner.jsonl has no step yet" in result.output


def _learner_run(run_dir, mode: str = "split") -> None:
    """A made-up run: its config, and learner steps that trained 2 s of every 2.2 s."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(f"placement: {{mode: {mode}}}\n")
    write_metrics(run_dir, "learner", [{"time": 100.0 + 2.2 * s, "step": s, "iteration_s": 2.2, "waiting_s": 0.2,
                                        "train_s": 2.0, "weight_sync_s": 0.0, "response_tokens": 10} for s in (1, 2, 3)])
    write_metrics(run_dir, "rollout0", [{"time": 100.0 + 2.2 * s, "iteration_s": 2.2, "waiting_s": 1.7, "busy_s": 0.5,
                                         "response_tokens": 10} for s in (1, 2, 3)])


def test_profile_advice_on_a_colocated_run_does_not_offer_a_staleness_that_runs_ahead(tmp_path):
    """Roles that work in shifts on the same devices overlap nothing: a larger max_staleness lets no
    generation run ahead of training there."""
    from launch.report import profile_run

    _learner_run(tmp_path / "split")
    _learner_run(tmp_path / "colocated", mode="colocate")
    split, colocated = profile_run(str(tmp_path / "split")), profile_run(str(tmp_path / "colocated"))
    assert split.bottleneck == colocated.bottleneck == "learner"
    assert "raising max_staleness lets generation run further ahead" in split.advice
    assert "run further ahead" not in colocated.advice and "work in shifts on the same devices" in colocated.advice


def test_profile_of_a_resumed_run_leaves_out_the_time_between_stop_and_resume(tmp_path):
    """A learner ran 14 s (8 of them starting), was stopped, and resumed 186 s later for 14 s more
    (9 starting): its wall time is 6 + 5 s, not the 211 s from its first record to its last."""
    from launch.report import profile_run

    def steps(started, startup):
        first = {"time": started + 10.0, "iteration_s": 10.0, "waiting_s": startup, "train_s": 10.0 - startup}
        return [first] + [{"time": started + 10.0 + 2 * i, "iteration_s": 2.0, "waiting_s": 0.5, "train_s": 1.5}
                          for i in (1, 2)]

    learner = [{"step": step, "response_tokens": 100, "weight_sync_s": 0.0, **record}
               for step, record in enumerate(steps(1000.0, 8.0) + steps(1200.0, 9.0), 1)]
    write_metrics(tmp_path, "learner", learner)
    write_metrics(tmp_path, "buffer", [{"time": 1014.0, "elapsed_s": 14.0, "busy_s_total": 1.0},
                                       {"time": 1219.0, "elapsed_s": 19.0, "busy_s_total": 2.0}])
    write_metrics(tmp_path, "startup", [{"role": "tether run", "phase": "start roles", "start": start, "end": start + 1}
                                        for start in (999.0, 1199.0)])
    profile = profile_run(str(tmp_path))
    learner_profile = next(role for role in profile.roles if role.role == "learner")
    assert learner_profile.wall_s == pytest.approx(11.0) and learner_profile.startup_s == pytest.approx(17.0)
    assert learner_profile.seconds["waiting"] == pytest.approx(2.0)  # the four steady-state waits
    assert learner_profile.busy_fraction == pytest.approx(9 / 11)
    assert profile.pipeline_tokens_per_s == pytest.approx(600 / 11)
    buffer = next(role for role in profile.roles if role.role == "buffer")
    assert buffer.wall_s == pytest.approx(33.0) and buffer.seconds["handling"] == pytest.approx(3.0)


def test_profile_shows_what_packing_saves_on_the_learners_and_the_scorers_passes(tmp_path):
    """The padding and repeated prefixes of each role's passes, averaged over its records, beside the
    packing it ran: what a user reads before turning learner.packing on."""
    from launch.report import format_profile, profile_run

    _learner_run(tmp_path)
    (tmp_path / "config.yaml").write_text("placement: {mode: split}\nscorer: {packing: tree}\n")
    learner = [json.loads(line) for line in (tmp_path / "metrics" / "learner.jsonl").read_text().splitlines()]
    write_metrics(tmp_path, "learner", [{**r, "padding_share": 0.3 + 0.1 * i, "prefix_share": 0.5}
                                        for i, r in enumerate(learner)])
    write_metrics(tmp_path, "scorer0", [{"time": 100.0 + 2.2 * s, "iteration_s": 2.2, "waiting_s": 1.0, "busy_s": 1.2,
                                         "tokens": 500, "padding_share": 0.2, "prefix_share": 0.6} for s in (1, 2)])
    profile = profile_run(str(tmp_path))
    shares = {role.role: role.shares for role in profile.roles}
    assert shares["learner"] == pytest.approx({"padding_share": 0.4, "prefix_share": 0.5})
    assert shares["rollout0"] == {}
    text = format_profile(profile)
    assert "learner  padding  40%   repeated prefixes  50%   (learner.packing: none)" in text
    assert "scorer0  padding  20%   repeated prefixes  60%   (scorer.packing: tree)" in text
