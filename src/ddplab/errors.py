"""The one exception type that means "the user asked for something we cannot do".

The command line turns it into a single line on stderr and exit code 2; anything else
is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: an unknown key, a wrong type, a missing file, an unknown name."""

    exit_code = 2
