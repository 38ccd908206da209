"""The ``tessera`` command's exit statuses."""

#: It did what it was asked.
OK = 0
#: A bad flag, setting or request (argparse's own status for a usage error).
USAGE = 2
#: Stopped with Ctrl-C (the shell's 128 + SIGINT).
INTERRUPTED = 130
