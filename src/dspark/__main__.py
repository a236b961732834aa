"""The `dspark` entry point (console script and `python -m dspark`).

Until a command takes SIGINT over, a Ctrl-C ends the process the way the signal's default
would, without a traceback: nothing has started yet (dspark.signals.die_quietly)."""

import signal


def main() -> None:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        from .signals import die_quietly

        signal.signal(signal.SIGINT, die_quietly)
    from .cli import main as cli

    cli()


if __name__ == "__main__":
    main()
