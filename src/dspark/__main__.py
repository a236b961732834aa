"""The `dspark` entry point (console script and `python -m dspark`).

Until a command takes SIGINT over, a Ctrl-C ends the process the way the signal's default
would, without a traceback: nothing has started yet. The default is put back first thing, at
import, before any other module is read: `_signal` is the interpreter's own built-in module,
already loaded at start-up, so this import runs no Python code that a SIGINT could interrupt
(`import signal` first imports `enum`, which takes about a millisecond; CI once caught a
SIGINT inside it)."""

import _signal

if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)


def main() -> None:
    from dspark.cli.main import main as cli

    cli()


if __name__ == "__main__":
    main()
