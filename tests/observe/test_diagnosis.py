"""The watchdog's diagnosis of every rank's flight records (observe/diagnosis.py), in one
process: which rank diverged and where, whose backend failed, who is merely behind, and
that silence alone is never an error (a rank busy in a call that holds the GIL cannot
answer). The torchrun jobs that produce such records are in test_watchdog.py and
test_no_false_alarm.py."""

from dtensor_fsdp.observe.diagnosis import Entry, RankRecord, Verdict, diagnose


def _entry(seq: int, fqn: str, kind: str, nbytes: int, state: str, phase: str = "forward"):
    return Entry("0", seq, fqn, phase, kind, nbytes, 1, state, 2.0)


def _rank(
    rank: int, *entries: Entry, error: str | None = None, published_age_s: float | None = None
) -> RankRecord:
    return RankRecord(rank, list(entries), error, published_age_s)


def test_the_minority_rank_diverged() -> None:
    # W=3: ranks 0 and 2 agree on collective #5, rank 1 skipped a block.
    agreed = _entry(4, "blocks.0", "all_gather", 100, "done")
    records = {
        0: _rank(0, agreed, _entry(5, "blocks.1", "all_gather", 200, "waiting")),
        1: _rank(1, agreed, _entry(5, "blocks.2", "all_gather", 300, "waiting")),
        2: _rank(2, agreed, _entry(5, "blocks.1", "all_gather", 200, "waiting")),
    }
    verdict = diagnose(records, 3, answer_timeout_s=1.0)
    assert verdict.is_error and verdict.kind == "diverged"
    assert verdict.message.startswith(
        "FSDP ranks diverged at step 1: rank(s) [1] issued a different collective than "
        "rank(s) [0, 2]:\n"
        "  rank 0: all_gather #5 of 'blocks.1' in forward (200 B) at step 1, waiting for 2.0 s\n"
        "  rank 1: all_gather #5 of 'blocks.2' in forward (300 B) at step 1, waiting for 2.0 s\n"
    ), verdict.message
    assert "same fully_shard modules in the same order" in verdict.message


def test_reduce_scatter_of_another_size_suggests_the_fix() -> None:
    records = {
        r: _rank(r, _entry(9, "blocks.1", "reduce_scatter", n, "waiting", "backward"))
        for r, n in ((0, 5376), (1, 4288))
    }
    verdict = diagnose(records, 2, answer_timeout_s=1.0)
    assert verdict.kind == "diverged" and "rank(s) [1] issued" in verdict.message
    assert "set_reduce_scatter_unused_params(True)" in verdict.message


def _failed(records: dict[int, RankRecord], world_size: int, whose: str) -> Verdict:
    """The verdict, checked to be a backend failure of ``whose`` wait."""
    verdict = diagnose(records, world_size, answer_timeout_s=1.0)
    assert verdict.is_error and verdict.kind == "failed"
    expected = f"FSDP collective failed: the backend failed the wait of {whose}"
    assert verdict.message.startswith(expected), verdict.message
    return verdict


def test_a_backend_failure_names_the_rank_that_stopped_answering() -> None:
    done = _entry(18, "blocks.2", "reduce_scatter", 6464, "done", "backward")
    failed = _entry(19, "blocks.1", "reduce_scatter", 5376, "failed", "backward")
    records = {0: _rank(0, done, failed, error="RuntimeError: Connection reset by peer")}
    verdict = _failed(
        records, 2, "rank(s) [0]; rank(s) [1] stopped answering: no answer within 1 s"
    )
    assert (
        "rank 0: reduce_scatter #19 of 'blocks.1' in backward (5,376 B) at step 1, failed "
        "after 2.0 s; the backend raised: RuntimeError: Connection reset by peer\n"
        "    after reduce_scatter #18 of 'blocks.2' in backward (6,464 B) at step 1, done "
    ) in verdict.message
    assert verdict.message.endswith("  rank 1: no answer, and no record published")


def test_silence_alone_is_a_warning() -> None:
    # Rank 1 waits for rank 0, which gives no answer (busy in a call holding the GIL).
    done = _entry(10, "blocks.0", "reduce_scatter", 100, "done", "backward")
    records = {1: _rank(1, done, _entry(11, "root", "all_gather", 68, "waiting"))}
    verdict = diagnose(records, 2, answer_timeout_s=5.0)
    assert not verdict.is_error and verdict.kind == "silent"
    assert verdict.message.startswith(
        "FSDP straggler: rank(s) [0] gave no answer within 5 s and are not known to have failed"
    ), verdict.message
    assert "rank(s) [1] wait for them. No error: the wait goes on" in verdict.message
    assert "  rank 0: no answer, and no record published" in verdict.message


def test_a_published_record_that_is_stale_is_no_evidence() -> None:
    # Rank 0 published while it waited for #11 (a wait that outlasted its first
    # slice), went on and is now busy: rank 1 has completed #11 and waits for #12.
    done = _entry(11, "root", "all_gather", 68, "done")
    records = {
        0: _rank(0, _entry(11, "root", "all_gather", 68, "waiting"), published_age_s=30.0),
        1: _rank(1, done, _entry(12, "blocks.0", "all_gather", 100, "waiting")),
    }
    verdict = diagnose(records, 2, answer_timeout_s=5.0)
    assert not verdict.is_error and verdict.kind == "silent", verdict.message
    assert (
        "  rank 0: no answer; its record published 30.0 s before: all_gather #11 of 'root'"
    ) in verdict.message


def test_a_published_record_that_disagrees_is_a_divergence() -> None:
    # Rank 1 cannot answer (its GIL held by another thread), but published what it waits
    # for when its wait outlasted the first slice: another block than rank 0.
    records = {
        0: _rank(0, _entry(5, "blocks.1", "all_gather", 200, "waiting")),
        1: _rank(1, _entry(5, "blocks.2", "all_gather", 300, "waiting"), published_age_s=9.0),
    }
    verdict = diagnose(records, 2, answer_timeout_s=1.0)
    assert verdict.is_error and verdict.kind == "diverged"
    assert "rank(s) [1] issued a different collective than rank(s) [0]" in verdict.message
    assert "rank(s) [1] stopped answering" in verdict.message


def test_a_published_backend_failure_is_evidence() -> None:
    # W=3, rank 0 died: gloo failed the wait of its ring neighbour, rank 1, which
    # published that and exited; rank 2 waits on, and learns it from the store.
    failed = _entry(7, "root", "all_gather", 68, "failed")
    records = {
        1: _rank(1, failed, error="RuntimeError: Connection closed by peer", published_age_s=1.0),
        2: _rank(2, _entry(7, "root", "all_gather", 68, "waiting")),
    }
    _failed(records, 3, "rank(s) [1]; rank(s) [0, 1] stopped answering")


def test_a_rank_behind_is_a_straggler_not_an_error() -> None:
    done = _entry(10, "blocks.0", "reduce_scatter", 100, "done", "backward")
    records = {
        0: _rank(0, done, _entry(11, "root", "all_gather", 68, "waiting")),
        1: _rank(1, done),
    }
    verdict = diagnose(records, 2, answer_timeout_s=1.0)
    assert not verdict.is_error and verdict.kind == "straggler"
    assert verdict.message.startswith("FSDP straggler: rank(s) [1] are behind; rank(s) [0]")


def test_every_rank_waiting_for_the_same_collective_is_not_a_divergence() -> None:
    waiting = _entry(3, "root", "all_gather", 68, "waiting")
    verdict = diagnose({0: _rank(0, waiting), 1: _rank(1, waiting)}, 2, answer_timeout_s=1.0)
    assert not verdict.is_error and verdict.kind == "stuck"


def test_answers_from_different_moments_are_not_a_divergence() -> None:
    # Rank 0 answered while waiting for #11; by the time rank 1 answered, #11 had
    # completed (so rank 0 joined it) and rank 1 waits for #12.
    records = {
        0: _rank(0, _entry(11, "root", "all_gather", 68, "waiting")),
        1: _rank(
            1,
            _entry(11, "root", "all_gather", 68, "done"),
            _entry(12, "blocks.0", "all_gather", 100, "waiting"),
        ),
    }
    verdict = diagnose(records, 2, answer_timeout_s=1.0)
    assert not verdict.is_error and verdict.kind == "stuck", verdict.message


def test_ranks_waiting_in_different_groups_diverged() -> None:
    records = {
        0: _rank(0, Entry("0", 3, "a", "forward", "all_gather", 8, 0, "waiting", 1.0)),
        1: _rank(1, Entry("1", 7, "b", "forward", "all_gather", 8, 0, "waiting", 1.0)),
    }
    verdict = diagnose(records, 2, answer_timeout_s=1.0)
    assert verdict.is_error and "every rank waits in a different collective" in verdict.message
