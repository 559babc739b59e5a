"""tools/suite_times.py: docs/testing.md's test-time figures come from a run's output."""

import pytest

from tools.suite_times import main, parse, write_block

OUTPUT = """\
cores: 2
load average before: 0.12 0.40 0.33
........................................................................ [  5%]
============================= slowest 25 durations =============================
103.68s setup    tests/runtime/test_mixed_precision.py::test_all_gather_carries_dtypes
6.23s call     tests/runtime/test_training.py::test_llama_init[llama-w2]
0.05s teardown tests/runtime/test_training.py::test_mlp_init[mlp-w2]
1357 passed, 1 skipped, 1 xfailed in 1022.34s (0:17:02)
load average after: 1.90 1.70 1.10
"""


def test_the_figures_are_the_runs() -> None:
    run = parse(OUTPUT)
    assert run.counts == "1357 passed, 1 skipped, 1 xfailed"
    assert run.seconds == 1022.34
    assert run.slowest[0] == (
        103.68,
        "setup",
        "tests/runtime/test_mixed_precision.py::test_all_gather_carries_dtypes",
    )
    assert [phase for _, phase, _ in run.slowest] == ["setup", "call", "teardown"]
    assert run.machine == {
        "cores": "2",
        "load average before": "0.12 0.40 0.33",
        "load average after": "1.90 1.70 1.10",
    }


def test_a_run_that_did_not_finish_is_refused() -> None:
    with pytest.raises(ValueError, match="did the run finish"):
        parse(OUTPUT.replace("1357 passed, 1 skipped, 1 xfailed in 1022.34s (0:17:02)", ""))


def test_only_the_named_block_is_replaced(tmp_path) -> None:
    document = tmp_path / "testing.md"
    document.write_text(
        "# Testing\nkept\n<!-- test-times:full -->\nold\n<!-- /test-times:full -->\n"
        "<!-- test-times:fast -->\nold fast\n<!-- /test-times:fast -->\ntail\n"
    )
    log = tmp_path / "ci.log"
    log.write_text(OUTPUT)
    main([str(log), "--write", str(document)])
    text = document.read_text()
    assert text.startswith("# Testing\nkept\n<!-- test-times:full -->\n`.ci/run`: 1357 passed")
    assert "in 17 min 02 s." in text and "Machine: cores 2; load average before" in text
    assert "| 103.7 | setup | `tests/runtime/test_mixed_precision.py::" in text
    assert "old\n" not in text and "old fast" in text and text.endswith("tail\n")
    with pytest.raises(ValueError, match="no block"):
        write_block("no markers here", "full", "x")


def test_command_names_what_ran(tmp_path) -> None:
    document = tmp_path / "testing.md"
    document.write_text("<!-- test-times:full -->\nold\n<!-- /test-times:full -->\n")
    log = tmp_path / "dev.log"
    log.write_text(OUTPUT)
    main([str(log), "--write", str(document), "--command", "the README's test command"])
    assert document.read_text().startswith(
        "<!-- test-times:full -->\n`the README's test command`: 1357 passed"
    )
