"""The one base class of errors caused by the user's input (options, files, data).

Entry scripts print such an error as one line, without a traceback, and exit with status 2.
"""


class UserError(Exception):
    """An error in what the user gave us; its message is one line naming the option or file."""
