"""The `topk-nb` console script. It installs its SIGINT and SIGTERM handlers before it imports `topk_nb`, whose
first import (torch) takes seconds: an interrupt then ends the command with one line and 128 + the signal
(130, 143), never a traceback. A run installs its own handlers once it starts (`topk_nb.runner.batch.run_plan`,
`topk_nb.runner.slurm.run_plan_on_slurm`) and gives these back when it ends."""
import signal
import sys


def _interrupted(signum, frame):
    "Say which signal ended the command, in one line, and exit with 128 + its number (files being written are cleaned up on the way out)."
    for s in (signal.SIGINT, signal.SIGTERM): signal.signal(s, signal.SIG_IGN)
    print(f"topk-nb: interrupted by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def main() -> int:
    "Install the handlers, then run `topk_nb.runner.cli.main`."
    for s in (signal.SIGINT, signal.SIGTERM): signal.signal(s, _interrupted)
    from topk_nb.runner.cli import main as cli_main
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
