"""docs/testing.md's test-time figures, written from a test run's output, not by hand.

    .ci/run 2>&1 | tee ci.log                                    # the full suite
    python tools/suite_times.py ci.log                            # print the figures
    python tools/suite_times.py ci.log --write docs/testing.md    # replace its "full" block
    python -m pytest tests -n 2 --dist loadfile -m "not full" -q -p no:cacheprovider \\
        --durations=25 2>&1 | tee fast.log                       # the fast tier
    python tools/suite_times.py fast.log --write docs/testing.md --block fast

``--command`` names what ran where it is not the block's usual command (the README's
test command in the development venv rather than ``.ci/run``'s fresh one).

Reads pytest's summary line (``1358 passed, 1 skipped in 1022.31s (0:17:02)``), its
``--durations`` table and the lines ``.ci/run`` prints around the tests (the machine's
cores and load average before and after: figures from a loaded machine say so). The
block in the document sits between ``<!-- test-times:NAME -->`` and
``<!-- /test-times:NAME -->``; nothing else in the file changes.
"""

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

_SUMMARY = re.compile(r"^=* ?(?P<counts>(?:\d+ \w+(?:, )?)+) in (?P<seconds>[\d.]+)s")
_DURATION = re.compile(r"^(?P<seconds>[\d.]+)s (?P<phase>setup|call|teardown) +(?P<test>\S+)")
_MACHINE = re.compile(r"^(?P<what>cores|load average (?:before|after)): (?P<value>.+)$")


@dataclass(frozen=True)
class Run:
    """What one pytest run's output says of its time."""

    counts: str  # "1358 passed, 1 skipped"
    seconds: float
    slowest: list[tuple[float, str, str]]  # (seconds, phase, test id), slowest first
    machine: dict[str, str]  # "cores", "load average before", "load average after"


def parse(text: str) -> Run:
    """The figures of one run's output.

    Raises:
        ValueError: the output has no pytest summary line (the run did not finish).
    """
    summary, slowest, machine = None, [], {}
    for line in text.splitlines():
        line = line.strip()
        if match := _SUMMARY.match(line.strip("= ")):
            summary = match
        elif match := _DURATION.match(line):
            slowest.append((float(match["seconds"]), match["phase"], match["test"]))
        elif match := _MACHINE.match(line):
            machine[match["what"]] = match["value"].strip()
    if summary is None:
        raise ValueError("no pytest summary line ('N passed ... in S s'): did the run finish?")
    return Run(summary["counts"].rstrip(", "), float(summary["seconds"]), slowest, machine)


def _minutes(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s"


def render(run: Run, command: str) -> str:
    """The figures as markdown: the totals, the machine, the slowest tests."""
    lines = [f"`{command}`: {run.counts} in {_minutes(run.seconds)}."]
    if run.machine:
        machine = "; ".join(f"{k} {v}" for k, v in run.machine.items())
        lines.append(f"Machine: {machine}.")
    if run.slowest:
        lines += ["", "| seconds | phase | test |", "| ---: | --- | --- |"]
        lines += [f"| {s:.1f} | {phase} | `{test}` |" for s, phase, test in run.slowest]
    return "\n".join(lines)


def write_block(document: str, name: str, body: str) -> str:
    """``document`` with block ``name``'s contents replaced by ``body``.

    Raises:
        ValueError: the document has no such block.
    """
    begin, end = f"<!-- test-times:{name} -->", f"<!-- /test-times:{name} -->"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(document):
        raise ValueError(f"no block {begin} ... {end} in the document")
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", document, count=1)


COMMANDS = {
    "full": ".ci/run",
    "fast": (
        'python -m pytest tests -n 2 --dist loadfile -m "not full" -q -p no:cacheprovider'
        " --durations=25"
    ),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path, help="the run's output")
    parser.add_argument("--write", type=Path, help="the document whose block to replace")
    parser.add_argument("--block", choices=sorted(COMMANDS), default="full")
    parser.add_argument("--command", help="what ran, if not the block's usual command")
    args = parser.parse_args(argv)
    body = render(parse(args.log.read_text()), args.command or COMMANDS[args.block])
    if args.write is None:
        print(body)
        return
    args.write.write_text(write_block(args.write.read_text(), args.block, body))


if __name__ == "__main__":
    sys.exit(main())
