"""The `dspark` entry point (console script and `python -m dspark`).

Until a command takes SIGINT over, a Ctrl-C ends the process the way the signal's default
would, without a traceback: nothing has started yet. The default is put back first thing, at
import, before any other dspark module is read (an interrupted import would print one)."""

import signal

if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def main() -> None:
    from .cli import main as cli

    cli()


if __name__ == "__main__":
    main()
