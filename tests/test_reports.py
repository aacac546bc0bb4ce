"""What a user reads of a run: `tether status`, `tether plot`, the console line and the logs."""

import json

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
